"""The default job: a tiny LLaMA-style model on Python's own sources, on 8 simulated CPU
devices laid out as two clusters (InfiniBand and RoCE, 2 nodes x 2 devices each) joined by
Ethernet — Holmes' hybrid setting in miniature.

The layout follows hetjax's rule: pipeline stages across clusters (only activations cross
Ethernet), data parallelism inside each cluster (gradients stay on its RDMA fabric), tensor
parallelism inside each node. Set parallel.pp=0 and parallel.tp=0 to let the planner choose
instead (`hetjax plan` shows what it would pick and why).

    hetjax train --config=configs/default.py --config.train.steps=100
"""

from hetjax.config import base_config


def get_config():
    config = base_config()
    config.parallel.pp = 2  # one stage per cluster
    # replicas inside a cluster: the rest of the devices, 2 on the default topology (0 keeps the
    # job valid when only --config.topology.* changes: `hetjax` runs this job without --config)
    config.parallel.dp = 0
    config.parallel.tp = 2  # shards inside a node
    config.pipeline.schedule = "1f1b"
    config.train.microbatches = 4
    config.eval.every = 100  # loss on held-out documents, also reported in the summary
    return config
