"""Deployment: artifacts for a Cloud AI 100 card, and serving them.

* :mod:`.export` - ``export_for_qaic``: one retained-state ONNX model per LLM with
  ``custom_io.yaml``, ``specializations.json`` and the qaic-compile command, in
  QEfficient's conventions;
* :mod:`.serving` - ``DisaggregatedServer``: prefill and decode in separate processes
  with a zero-copy KV hand-off;
* :mod:`.naming` - the retained-state names both use.

The serving side never imports the export's modules: what they share is in
:mod:`.naming`. This package imports neither on its own, so a serving worker does not
pay for the exporter.
"""
