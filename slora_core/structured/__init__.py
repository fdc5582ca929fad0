"""Constrained decoding (DESIGN section 3): a grammar per request, compiled off the step loop
and cached by (schema digest, tokenizer); its token bitmask joins the sampler's batch.

`spec` is plain Python (the service edge validates with it); the grammar libraries (xgrammar,
llguidance as its fallback) are imported only by `backend`, when an engine first needs them.
"""

from slora_core.structured.spec import (
    KINDS,
    MAX_SPEC_BYTES,
    StructuredOutput,
    StructuredOutputError,
)

__all__ = ["KINDS", "MAX_SPEC_BYTES", "StructuredOutput", "StructuredOutputError"]
