"""The replica's engine part: vLLM's `AsyncLLM` and its weights (`vllm_engine`, `engine_args`,
`worker_ext`), vLLM's own OpenAI serving classes over it (`openai_serving`), the tap between the
two that labels policy versions and hands every answer to the experience log (`engine_tap`,
`experience_log`), and what the trainer reproduces of a request's sampling (`reproducible`).

It never imports the HTTP part (`serve_rft.explorer.http`), the deployment
(`serve_rft.explorer.replica`) or a web framework: `tests/unit/test_layering.py`.
"""
