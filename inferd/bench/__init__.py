"""`inferd bench`: a load generator and report for OpenAI-compatible servers (inferd, vLLM, llama.cpp, SGLang).

Modules, one job each: datasets (what to send), client (one streaming request and its timings), metrics
(pure functions on timings), cost, report (console), plots (PNG), runner (a run or a sweep), compare (runs
side by side), cli (`inferd bench serve | compare`). When requests are sent and how percentiles are taken
come from the measuring library every other part of inferd uses too (`inferd.measure`).
"""
