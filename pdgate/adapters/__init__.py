"""The engine seam: everything an engine kind decides, behind one Protocol (``docs/architecture.md``, "Engines").

The request path, health checks, reconciliation and registration ask a worker's adapter (``Worker.adapter``)
and never name an engine. An adapter is chosen per worker (``engine`` in the config's worker tables or in a
registration), so one gateway can front pools of two kinds; a pair is always of one kind.

What an adapter says:

- the two legs' bodies for an attempt (``legs``), and whether they run at once (SGLang: both legs with the
  same bootstrap room) or in sequence (the decode's body made from the prefill's answer: ``decode_after``);
- the abort of one leg, and its order (``defers_decode_abort``: an engine without the abort-during-transfer
  fix gets a decode's abort only once its transfer is over);
- probes: health and identity (``probe``, a ``Probe`` value), the unauthenticated registration probe
  (``identify``), the requests an engine holds by rid where it lists them (``held``);
- what an answer carries: usage (``usage``) and the merge of the prefill's answer into the decode's (``merge``);
- how its stream's terminal events look (``done_event``, ``error_event``: the relay's framer).
"""

from __future__ import annotations

from pdgate.adapters.base import Engine, Held, Probe, Usage

__all__ = ["Engine", "Held", "Probe", "Usage"]
