"""`inferd bench`: a load generator and report for OpenAI-compatible servers (inferd, vLLM, llama.cpp, SGLang).

Modules, one job each: datasets (what to send), arrivals (when), client (one streaming request and its
timings), metrics (pure functions on timings), cost, report (console), plots (PNG), runner (a run or a
sweep), compare (runs side by side), cli (`inferd bench serve | compare`).
"""
