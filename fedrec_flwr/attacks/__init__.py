"""Attacks that measure what a trained federated recommender reveals (pure functions; reusable on any run).

* :mod:`.attribute_inference`: an attacker who knows some users' attribute predicts the others' from their user
  embeddings (scikit-learn classifiers; AUC, balanced accuracy, macro-F1).
* :mod:`.label_leakage`: an honest-but-curious server recovers a client's private label from its uploaded adversary
  update (iDLG, analytic; DLG, gradient matching).
* :mod:`.membership`: an attacker separates a user's training items from items it never interacted with by the
  model's scores (ROC AUC; used to check that unlearned users' interactions stop being detectable).
"""

from fedrec_flwr.attacks.attribute_inference import AttributeAttackResult, attribute_inference, collect_user_embeddings
from fedrec_flwr.attacks.label_leakage import dlg_label, idlg_label
from fedrec_flwr.attacks.membership import membership_auc, nonmember_items

__all__ = [
    "AttributeAttackResult",
    "attribute_inference",
    "collect_user_embeddings",
    "dlg_label",
    "idlg_label",
    "membership_auc",
    "nonmember_items",
]
