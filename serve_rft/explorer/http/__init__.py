"""The replica's HTTP part: the FastAPI app and its error JSON (`app`), the routes (`openai_routes`,
`admin_routes`), what a client may send and how it is bounded (`body`, `protocol`,
`openai_request`, `sync_api`), who may call what (`auth`, `quota`), rewards (`rewards_api`), the
API document (`openapi`) and what the replica reads of its front door (`ingress_mode`).

It may import the engine part (`serve_rft.explorer.engine`), never the deployment
(`serve_rft.explorer.replica`, `weight_swap`, `router`): `tests/unit/test_layering.py`.
"""
