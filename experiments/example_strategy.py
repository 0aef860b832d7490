"""The worked plug-in strategy, kept under its old name: it lives in :mod:`plugins.server_lr` now (``plugins/`` ships
with the app and holds a plug-in's own run-config keys, here ``server-lr``)::

    bash experiments/quickstart.sh strategy=plugins.server_lr:ServerLrItemFedAvg server-lr=0.3
"""

from plugins.server_lr import ServerLrItemFedAvg

__all__ = ["ServerLrItemFedAvg"]
