"""The CPU profile: real SGLang 0.5.23 PD on a machine with no GPU (``config/kernels/cpu.toml``).

Applied like fixes A/B/C (``engine.sglang.worker``, in every SGLang process, never by editing installed files);
each piece is checked against the pinned version's source first and refused with what did not match. Facts and
how they were found: ``../shared/reference/real-engines-cpu.md``, docs/fidelity.md.

- ``sgl_kernel`` (no CPU build on PyPI): on a CPU without AMX the request path calls one of its functions,
  ``assign_req_to_token_pool_cpu`` (``srt/mem_cache/allocation.py``). A stand-in module gives that one function in
  torch; any other name resolves (imports at start do not fail) to a placeholder that raises, naming the stand-in,
  when called. So SGLang's ``try: from sgl_kernel import ... except ImportError`` fallbacks are not taken: fine
  for the tiny Llama served here (the real tier), untried for other models.
- ``torchvision`` is imported at start by multimodal code a text model never runs (PyPI's wheel is CUDA-linked and
  does not import against a CPU torch). A stand-in is put in its place only when the real one cannot be imported;
  calling any of it raises. (transformers then takes torchvision for available: its image paths would raise, a
  text model does not use them.)
- The prefill's KV send (``SchedulerDisaggregationPrefillMixin._send_kv_chunk``) pins a host copy of the page
  indices and records a CUDA event when the sender ``supports_host_tensor_indices`` (mooncake's does): with no
  driver that fails the first transfer. The indices are host tensors here already, so the mooncake sender is told
  it does not support them and the send takes SGLang's own other branch (``kv_to_page_indices``).
- Server arguments (the profile's ``[args]``, given by the planner): ``--device cpu`` (with
  ``SGLANG_USE_CPU_ENGINE=1``), the torch attention backend, no overlap schedule, ``--sleep-on-idle``, and the
  decode's retraction backup in CPU tensors (its default registers host memory with CUDA).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

NAME = "cpu"
# piece -> (module, what its source must contain)
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kernel": ("sglang.srt.mem_cache.allocation", ("from sgl_kernel import assign_req_to_token_pool_cpu",
                                                   "assign_req_to_token_pool_cpu(\n            req_pool_indices,\n"
                                                   "            req_to_token,\n            start_offset,\n"
                                                   "            end_offset,\n            out_cache_loc,\n"
                                                   "            req_to_token.shape[1],\n        )")),
    "host-indices": ("sglang.srt.disaggregation.prefill", ('getattr(sender, "supports_host_tensor_indices", False)',
                                                          "indices_event = torch.cuda.Event()",
                                                          "page_indices = kv_to_page_indices(kv_indices, page_size)")),
    "sender": ("sglang.srt.disaggregation.mooncake.conn", ("class MooncakeKVSender(CommonKVSender):\n"
                                                          "    supports_host_tensor_indices = True",)),
}
SENDER = ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVSender")


class Refused(RuntimeError):
    pass


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any,
                                 out_cache_loc: Any, pool_len: int) -> None:
    """sgl_kernel's CPU kernel in torch: for each request i, ``req_to_token[req_pool_indices[i], start:end]`` takes
    the next ``end - start`` entries of ``out_cache_loc`` (requests in order)."""
    at = 0  # as the triton kernel: request i's entries start at the sum of (end - start) of those before it
    for pool, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = int(end) - int(start)
        if n > 0:
            if int(end) > pool_len:
                raise IndexError(f"assign_req_to_token_pool_cpu: end {end} past the pool's {pool_len} tokens")
            req_to_token[int(pool), int(start):int(end)] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


class _StandIn(types.ModuleType):
    """A module that has only what it was given; any other name raises, saying it is pdgate's CPU stand-in."""

    def __init__(self, name: str, why: str, **given: Any) -> None:
        super().__init__(name, f"pdgate's CPU stand-in for {name}: {why}")
        self.__dict__.update(given)
        self.__path__: list[str] = []  # a package: its submodules are stand-ins too (_Finder)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec() asks for it
        self.__pdgate_stand_in__ = why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}", self.__pdgate_stand_in__)


class _Unavailable:
    """A name used at import time (a default argument, ``InterpolationMode.BICUBIC``): it exists; using it raises."""

    def __init__(self, name: str, why: str) -> None:
        self._name, self._why = name, why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}", self._why)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is not available on pdgate's CPU profile ({self._why})")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # a class deriving from a stand-in class still defines

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Submodules of a stand-in (``torchvision.transforms.functional``) are stand-ins."""

    def __init__(self, roots: dict[str, str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        root = fullname.split(".")[0]
        if root in self.roots and fullname != root and root in sys.modules \
                and isinstance(sys.modules[root], _StandIn):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandIn(spec.name, self.roots[spec.name.split(".")[0]])

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # a CUDA-linked wheel fails with RuntimeError, a missing one ImportError
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]  # what a failed import left half-made
        return False


def install_stand_ins() -> list[str]:
    """Before SGLang is imported: ``sgl_kernel`` (always: the CPU path must get our function, not a CUDA build's
    import error) and ``torchvision`` (only where the real one does not import). Returns what was stood in."""
    roots = {"sgl_kernel": "no CPU build of sgl_kernel on PyPI; only assign_req_to_token_pool_cpu is given",
             "torchvision": "torchvision does not import against this torch; a text model does not use it"}
    done = []
    sys.modules["sgl_kernel"] = _StandIn("sgl_kernel", roots["sgl_kernel"],
                                         assign_req_to_token_pool_cpu=assign_req_to_token_pool_cpu)
    done.append("sgl_kernel")
    if not _importable("torchvision"):
        sys.modules["torchvision"] = _StandIn("torchvision", roots["torchvision"], __version__="0.0+pdgate-stand-in")
        done.append("torchvision")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(roots))
    return done


def source(module: str) -> str:
    """An SGLang module's source, read from its file without importing it (SGLang imports torch)."""
    spec = importlib.util.find_spec("sglang")  # a top-level find: nothing imported
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return (root / (module.replace(".", "/") + ".py")).read_text()


def check() -> list[str]:
    """What in the installed SGLang does not match what this profile was written against (empty: all matches)."""
    problems = []
    for piece, (module, needles) in SOURCES.items():
        try:
            text = source(module)
        except (ImportError, OSError) as exc:
            problems.append(f"cpu profile {piece}: {module} not readable ({exc})")
            continue
        problems += [f"cpu profile {piece}: {module} no longer has {n.splitlines()[0]!r}" for n in needles
                     if n not in text]
    return problems


def apply(force: bool) -> list[str]:
    """Check, then patch: the mooncake sender sends host page indices the way every other sender does."""
    problems = check()
    if problems and not force:
        raise Refused("; ".join(problems))
    try:
        sender = getattr(importlib.import_module(SENDER[0]), SENDER[1])
    except (ImportError, AttributeError) as exc:  # forced past a missing sender: said, not a traceback
        return [*problems, f"cpu profile host-indices: {SENDER[0]}.{SENDER[1]} not patched ({exc})"]
    sender.supports_host_tensor_indices = False
    return problems
