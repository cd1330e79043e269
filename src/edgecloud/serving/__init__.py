"""The self-hosted side: what a team runs behind an OpenAI-compatible URL (``edgecloud serve``).

``server`` (the FastAPI app), ``batching`` and the two engines' schedulers (llama.cpp:
``llamacpp_engine`` / ``llamacpp_scheduler``; torch: ``engine_backend`` / ``scheduler``, on
the model code of :mod:`edgecloud.engine`), ``speculative`` (proposers and the server's
speculation controller), ``engine_choice`` / ``fp8_check`` (what ``--engine auto`` and
``--precision auto`` pick) and the vLLM launcher (``vllm`` / ``vllm_launch``). The SDK's
HTTP client is :mod:`edgecloud.remote`; nothing here is imported by ``import edgecloud``
(torch and FastAPI are the ``cloud`` extra).
"""
