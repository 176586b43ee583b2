"""A tiny model made here, for the real engines on CPU: no model hub, nothing downloaded.

``python -m engine.model --out DIR`` (run with an engine's virtual environment: it needs torch, transformers and
tokenizers) writes a random ``LlamaForCausalLM`` (hidden 128, 2 layers, 4 heads / 2 KV heads, bf16, ~0.6 M
parameters, weights from a fixed seed) and a byte-level BPE tokenizer (vocab 1,024, trained on this Python's own
standard library sources, sorted: the same files give the same merges) with a chat template, ~1.3 MB. The words
it answers are random; the protocol is what real-engine tests exercise. A directory already holding the same
build (``pdgate-model.json``) is left as it is: a second call takes a moment.

Tool calls: the template renders ``tools`` into the system turn and the tokenizer knows ``<tool_call>`` and
``</tool_call>``, so vLLM's ``hermes`` tool parser loads and a tool-calling request is accepted (the model will not
call a tool on purpose: its words are random).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

BUILD = 1  # bump when anything below changes what is written
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<tool_call>",
            "</tool_call>"]
VOCAB = 1024
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call these tools, each call as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>: {{ tools | tojson }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool|>{% else %}<|{{ m['role'] }}|>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{% if p['text'] is defined %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "rope_theta": 10000.0}


def corpus(limit: int = 60) -> list[str]:
    """The training text: the first ``limit`` of this Python's standard library modules, sorted by name."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 2000)[:limit]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stamp = {"build": BUILD, "seed": seed, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    marker = out / "pdgate-model.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp and (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", model_max_length=CONFIG["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), bos_token_id=bos, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, torch_dtype="bfloat16", **CONFIG)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    marker.write_text(json.dumps(stamp))
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the model directory (made, or left as it is when up to date)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(build(Path(a.out), a.seed))


if __name__ == "__main__":
    main()
