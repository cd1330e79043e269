"""What every decoder shares, whichever side runs it: the parts below the edge runtimes and the
serving engines, importing neither.

- decoding: ``sampling`` (request options to sampler settings, the one token chooser),
  ``llamacpp_sampler``, ``text_stream``, ``chunks`` (an answer as OpenAI-shaped chunks),
  ``completions`` (the legacy text-completion shapes), ``stats``;
- held output: ``structured`` (``response_format`` grammars), ``tool_grammar`` (call grammars),
  ``grammar_mask`` (llama.cpp's grammar engine over foreign logits);
- models: ``gguf``, ``tokenizer``, ``chat_template``, ``llama_cpp`` (the import), ``llamacpp_batch``,
  ``prefix_cache``, ``hardware``, ``coreml_package`` (the exported package's contract);
- collaboration maths: ``scoring`` (scoring a continuation, token sessions), ``speculative``
  (accept a prefix, estimate acceptance, choose k).
"""
