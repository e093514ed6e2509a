"""The multi-node flags of `areno train` (part of the `basic` group): nodes started by hand, and restarts."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.fields import ConfigError, check_non_negative, opt


@dataclass
class ClusterSection:
    """`--help` group basic (several nodes)."""

    nnodes: Optional[int] = opt(None, "nodes of a run started by hand on each node (each runs the same command with "
                                "its --node-rank); under Slurm's srun, Kubeflow's PyTorchJob or SkyPilot the "
                                "launcher's own value (a different one is refused)", "basic",
                                default_help="the launcher's, else 1")
    node_rank: Optional[int] = opt(None, "this node's index in [0, --nnodes); node 0 hosts the rendezvous",
                                   "basic", default_help="0", needs="nodes")
    master_addr: Optional[str] = opt(None, "host of node 0 (the c10d rendezvous), as the other nodes reach it "
                                     "(under Slurm: instead of the first host of the step)", "basic",
                                     metavar="HOST", default_help="127.0.0.1", needs="nodes")
    master_port: Optional[int] = opt(None, "port of the c10d rendezvous on --master-addr", "basic",
                                     default_help="the launcher's, else 29500 (a free one on one node)")
    max_restarts: int = opt(0, "when a rank or node dies, stop the others, re-form the group and resume from the "
                            "last complete checkpoint up to N times (torch's elastic agent)", "basic",
                            needs="saved")
    rdzv_timeout: int = opt(600, "seconds the nodes have to join the rendezvous (at the start and after a restart); a "
                            "node still missing then ends the run on the others with one line naming the "
                            "rendezvous (torchrun's join_timeout)", "basic", metavar="SECONDS", needs="nodes")

    def check_cluster(self):
        check_non_negative("--max-restarts", self.max_restarts)
        if self.rdzv_timeout < 1:
            raise ConfigError("--rdzv-timeout", f"must be at least 1 second, got {self.rdzv_timeout}")
        if self.nnodes is not None and self.nnodes < 1:
            raise ConfigError("--nnodes", f"must be at least 1, got {self.nnodes}")
        if self.node_rank is not None and (self.node_rank < 0 or self.node_rank >= (self.nnodes or 1)):
            raise ConfigError("--node-rank", f"{self.node_rank} is not in [0, --nnodes {self.nnodes or 1})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError("--master-port", f"{self.master_port} is not a TCP port")
