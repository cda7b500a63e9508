"""A fleet: models served by pools of engine replicas behind one gateway, described by one YAML spec.

`spec.py` is the spec every fleet tool reads: `inferd up` (`inferd.runtime`) runs it on this machine, the autoscaler and
the simulator take its policies, `inferd deploy` renders it for Kubernetes and Ray.
"""
