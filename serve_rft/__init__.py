"""serve_rft: serve an LLM with vLLM on Ray Serve and improve it online with RL.

Runtime roles, one subpackage each: ``explorer`` (vLLM replicas + OpenAI API), ``buffer``
(Redis experience store), ``trainer`` (policy-gradient updates), ``synchronizer`` (rolling
weight sync), ``service`` (wiring and launch), ``demo`` (a simulated user population).
"""

__version__ = "0.1.0"
