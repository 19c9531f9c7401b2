"""``qosd proxy``: qosd's admission in front of OpenAI-compatible model servers.

A team that serves an OpenAI-compatible API (vLLM, SGLang, TGI, llama.cpp) puts this
proxy in front of it and changes no gateway code: each request is admitted, queued or
refused by the same rules, store and config as ``qosd serve`` (in the same process),
forwarded to the least-loaded upstream of its model, settled with the usage the
server reports, and its latencies reported to the SLO loop (docs/proxy.md).
"""
