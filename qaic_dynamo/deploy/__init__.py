"""Deployment: artifacts for a Cloud AI 100 card, and serving them.

* :mod:`.export` - ``export_for_qaic``: one retained-state ONNX model per LLM with
  ``custom_io.yaml``, ``specializations.json`` and the qaic-compile command, in
  QEfficient's conventions;
* :mod:`.serving` - ``DisaggregatedServer``: prefill and decode in separate processes
  with a zero-copy KV hand-off;
* :mod:`.api_server` - ``qaic-dynamo serve``: an OpenAI-compatible HTTP server over ``LLM``;
* :mod:`.naming` - the retained-state names the export and the serving both use;
  :mod:`.exported` and :mod:`.ort_model` - reading an export and running it on ONNX Runtime.

The serving side never imports the export's modules: what they share is in
:mod:`.naming`. This package imports neither on its own, so a serving worker does not
pay for the exporter.
"""
