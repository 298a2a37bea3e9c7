"""Every benchmark of megatron-prt: measured side by side on local CPU ranks, and simulated.

``megatron-prt bench`` (:mod:`.sections`, flags in :mod:`.flags`, standard library only)
runs two measured sections, each a launch of its own gloo ranks writing a markdown report, a
PNG chart and the raw data under ``--out`` (default ``out/bench``):

* :mod:`.layer_stack`: an MLP layer stack under megatron-prt's 1F1B and PRT plans and under
  torch.distributed.pipelining's schedules (``vs_torch_pipelining.*``);
* :mod:`.bert`: megatron-core's BertModel under megatron-prt's 1F1B and PRT plans through
  the megatron forward-backward function (``megatron_bert.*``; the megatron side is
  :mod:`megatron_prt.megatron.bench`).

The scripts in ``benchmarks/`` call the others: :mod:`.paper_scale` (simulated, costs from
:mod:`megatron_prt.sim.analytic` and H200 profiles), :mod:`.partition_memory` (memory-balanced
partitions of a megatron-core BERT, predicted and measured) and :mod:`.runtime_speed`.
:mod:`.common` holds the measuring helpers the measured sections share, :mod:`.report` renders
every report (markdown tables, head, chart). Nothing in megatron_prt.core, .sim, .tune,
.runtime or .megatron imports this package.
"""
