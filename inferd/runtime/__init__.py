"""Runtimes: what starts and supervises processes for a fleet spec (`inferd.fleet.spec`).

`up.py` is `inferd up`: the gateway, the replica processes and the autoscaler loop on this machine, with
the disaggregated models' proxies and list files (`disagg.py`). It sits above the policy it runs
(`inferd.autoscale`) and the spec it reads, which import nothing of it.
"""
