"""The deployment and output section of the run configuration: the clients' state on disk, checkpoints and resuming,
the reply check, and where the results go.

:class:`DeploymentSection` declares the keys of the ``deployment, faults and checkpoints`` and ``output`` groups of
``[tool.flwr.app.config]`` (their defaults and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits
it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedrec_flwr.sections.fields import config_key


@dataclass(frozen=True)
class DeploymentSection:
    """The run-config keys of client state, checkpoints, reply checks and output folders."""

    client_state_dir: str = config_key("client-state-dir")
    checkpoint_every: int = config_key("checkpoint-every", minimum=0)
    resume_from: str = config_key("resume-from")
    resume_resets_client_state: bool = config_key("resume-resets-client-state")
    max_update_norm: float = config_key("max-update-norm", minimum=0.0)
    results_dir: str = config_key("results-dir")
    run_name: str = config_key("run-name")
