"""``megatron-prt bench``: measured side-by-side benchmarks on local CPU ranks.

Two sections, each a launch of its own gloo ranks writing a markdown report, a PNG chart and
the raw data under ``--out``:

* :mod:`.layer_stack`: an MLP layer stack under megatron-prt's 1F1B and PRT plans and under
  torch.distributed.pipelining's schedules (``vs_torch_pipelining.*``);
* :mod:`.bert`: megatron-core's BertModel under megatron-prt's 1F1B and PRT plans through
  the megatron forward-backward function (``megatron_bert.*``).

:mod:`.flags` (standard library only) holds the flags; :mod:`.sections` runs the sections.
Nothing in megatron_prt.core, .sim or .runtime imports this package.
"""
