"""Preset data: ``models/*.json`` (model architectures, read by :mod:`foundation.model`) and ``gpus.json``
(GPU kinds, read by :mod:`foundation.cluster`)."""
