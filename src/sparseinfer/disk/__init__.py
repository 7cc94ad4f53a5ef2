"""Beyond RAM: cold FFN neurons stay in the model file and are read per token.

    layout.py   the bundled file layout (``blk.N.ffn_bundle``: one neuron = one contiguous,
                aligned read; for ReLU gates optionally the gate rows apart,
                ``blk.N.ffn_bundle_gate``) and ``bundle_file``, which rewrites a sparse GGUF
                into it
    reader.py   ``NeuronReader``: O_DIRECT ``preadv`` from a thread pool, several reads in
                flight; a failed or short read is one ``DiskReadError``
    cache.py    ``NeuronCache``: per-layer slots for cold neurons, LRU or frequency-aware
                eviction, asynchronous requests and look-ahead prefetch
    plan.py     ``--ram-budget``: what the process holds (runtime, mapped weights, predictors, KV
                cache, buffers, caches) and the ILP placement of the hot neurons in what is left
    tier.py     ``DiskFFN``: the sparse FFN layer over RAM rows + cache + file, with the next
                layer's neurons prefetched while this one computes; with the gates apart, the
                cold neurons' gates first and up/down rows only where they fired

Run ``python -m sparseinfer.disk bundle SPARSE.gguf OUT.gguf`` once, then
``sparseinfer run -m OUT.gguf --ram-budget GiB``.
"""
