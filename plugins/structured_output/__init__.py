"""Structured output: constrain generation to a JSON Schema, a regular expression or an EBNF grammar
(xgrammar), per request.

Enable the feature, then set ``so_args`` on a request::

    llm = LLM(features=["structured_output"])            # or features = ["structured_output"] in TOML
    params = SamplingParams(max_tokens=200, so_args={
        "schema_type": "json",                            # "json" | "regex" | "ebnf"
        "schema": {"type": "object", ...},                # dict or JSON text; a regex; an EBNF grammar
        "trigger_token_ids": [...],                       # optional: constrain only after this sequence
        "bound_token_id": 42,                             # optional: the constraint ends at this token
    })

Semantics:

* Without ``trigger_token_ids`` the constraint applies from the first output token. With it, output is
  free until the token sequence appears in the output; the constraint starts with the next token.
* Without ``bound_token_id`` the grammar's stop tokens are the request's EOS tokens: once the grammar
  is complete only EOS is allowed, and the request ends normally with ``finish_reason == "stop"``.
  With it, the bound token is the only way out of a complete grammar; after it output is free again
  (and, with a trigger, the next occurrence of the trigger starts a new constrained span).
* A request whose ``so_args`` are malformed, whose grammar does not compile, or whose compilation
  exceeds ``compile_timeout_s`` fails alone (``finish_reason == "error"``, ``.error`` says why).

Grammars compile on builder threads while the request waits (it enters the batch once compiled) and
are cached (LRU keyed by (schema_type, schema)). Each step the feature fills each constrained
request's token bitmask and applies it to the logits on their device; the masks for step N+1 are
filled on a worker thread right after step N's tokens are accepted, so they overlap the next
forward pass.

Configuration: the ``[structured_output]`` table, each key overridable by environment:

====================  ======================================  =========  ====================================
key                   environment variable                    default    meaning
====================  ======================================  =========  ====================================
builder_threads       DEEPINFER_SO_BUILDER_CPUS               2          grammar compilation threads
compile_timeout_s     DEEPINFER_SO_COMPILE_TIMEOUT_S          30.0       a request fails if its grammar takes
                                                                         longer to compile
cache_size            DEEPINFER_XGRAMMAR_CACHE_SIZE           512        compiled grammars kept (LRU)
cache_limit_bytes     DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES    268435456  memory of the kept grammars (LRU)
any_whitespace        DEEPINFER_SO_ANY_WHITESPACE             false      JSON may contain free whitespace
                                                                         (default: compact ``{"a":1}``)
overlap               DEEPINFER_SO_OVERLAP                    true       fill next-step masks on a worker
                                                                         thread while the forward runs
====================  ======================================  =========  ====================================

The table's values win over the environment. For speculative decoding, ``StructuredOutput.state(request)``
returns the request's :class:`~plugins.structured_output.matcher.GrammarState`, whose
``validate_draft``, ``fill_draft_bitmasks``, ``accept_tokens`` and ``rollback`` check and undo draft
tokens.
"""
