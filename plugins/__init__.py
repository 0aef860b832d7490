"""Your own strategies and client algorithms: files here ship with the app (``fab-include`` has ``plugins/**/*.py``).

``flwr run`` runs the ServerApp and ClientApps from Flower's installed copy of the app, which holds only the files
``fab-include`` selects: a module elsewhere in the checkout is not found there. Put a plug-in here and name it as
``strategy=plugins.<file>:<Class>`` (or ``client=...``). A plug-in declares its own run-config keys in a class
attribute ``config_keys = {"key": (default, "meaning")}``; they are validated (by the default's type, and by the
class's ``check_config``), recorded in ``config.json``, and read as ``config.extra["key"]``. See
:mod:`plugins.server_lr`.
"""
