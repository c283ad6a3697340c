"""Parallelism beyond data parallel on one ``DeviceMesh``: the layout and its checks
(:mod:`.layout`), tensor parallelism (:mod:`.tensor`) and pipeline parallelism (:mod:`.pipeline`),
composed with FSDP2 by :func:`olmoflow.train.distributed.parallelize`."""
