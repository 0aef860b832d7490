"""Sections of the run configuration: each declares the run-config keys of one part of the package.

:class:`fedrec_flwr.config.RunConfig` inherits every section, so ``config.embedding_dim`` and the other attributes
read as one flat, frozen object. A section is a frozen dataclass whose fields are declared with
:func:`~fedrec_flwr.sections.fields.config_key` (the key's kebab-case name, its constraints and allowed values); the
key's default and meaning are written once, in ``[tool.flwr.app.config]`` of ``pyproject.toml``. A section checks its
own keys in one ``_check_*`` method; :meth:`RunConfig.from_mapping <fedrec_flwr.config.RunConfig.from_mapping>` calls
them after every value has its type and range.

The data section sits beside the data pipeline (:mod:`fedrec_flwr.data.config`), the client-unlearning section
beside the unlearning algorithms (:mod:`fedrec_flwr.unlearning.settings`); the others are here:
:mod:`~fedrec_flwr.sections.training` (model and local training), :mod:`~fedrec_flwr.sections.adversary` (FedAU²),
:mod:`~fedrec_flwr.sections.federation` (rounds, sampling, aggregation) and :mod:`~fedrec_flwr.sections.deployment`
(client state, checkpoints, output).
"""
