"""The engines' replica rules, one class per rule in one file each, found through one registry:
``vllm`` (:mod:`.vllm`), ``sglang`` (:mod:`.sglang`), ``trtllm`` (:mod:`.trtllm`) and ``ideal``
(:mod:`.ideal`, the LP optimum no engine implements). See :mod:`.base` for the interface.
Adding a rule: one module with a :func:`~.base.register`-ed :class:`~.base.ReplicaRule` subclass,
imported below."""
from moeplace.placement.rules import ideal, sglang, trtllm, vllm  # noqa: F401  registers the rules
from moeplace.placement.rules.base import ReplicaRule, get_rule, register, rule_names

__all__ = ["ReplicaRule", "get_rule", "register", "rule_names"]
