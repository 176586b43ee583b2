"""pdgate: a gateway for prefill/decode-disaggregated LLM serving (SGLang PD)."""

__version__ = "0.1.0"
