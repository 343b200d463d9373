"""Layer stacks: ``AttentionLayers`` and its presets ``Encoder``, ``Decoder``, ``CrossAttender``.

Shape legend: b batch, n new positions (queries), p cached positions, j context length,
c model width, c_ctx context width, h heads, d head dim.

Masks are built once per forward, at the top of the stack (``stack_forward.share_inputs``), and passed
down to every block.
Masks follow the one convention (bool, True = real / may attend):
- ``mask (b, n)``: padding of the sequence itself (becomes a ``(b, 1, 1, p + n)`` key mask, combined
  with the causal mask for a decoder only when there is padding: otherwise ``is_causal`` reaches the
  flash kernel).
- ``context_mask (b, j)``: padding of the context. An all-False row (a dropped condition) or a
  zero-length context makes every cross-attention an exact no-op for that sample (S2).

``AttentionLayers``' keywords (x-transformers' names; ``AttentionLayers.forward`` documents its own):

Args:
    dim: model width c.
    depth: number of layers; each is [self-attention] [cross-attention] feed-forward (optional with
        ``custom_layers``).
    heads: query heads.
    dim_head: head dim.
    kv_heads: key/value heads for grouped-query attention (default ``heads``).
    causal: causal self-attention (a decoder).
    cross_attend: add a cross-attention block to every layer (takes ``context``).
    only_cross: cross-attention without self-attention (``CrossAttender``).
    dim_context: context width c_ctx (default ``dim``).
    ff_mult: feed-forward hidden width multiplier.
    ff_glu: gated feed-forward (GEGLU; SwiGLU with ``ff_swish``).
    ff_swish: SiLU activation in the feed-forward.
    use_rmsnorm: RMSNorm instead of LayerNorm.
    norm_eps: the norms' epsilon (default 1e-5 for LayerNorm, 1e-6 for RMSNorm).
    use_scalenorm: every norm is x-transformers' ``ScaleNorm``: ``x / ||x|| * sqrt(c) * g`` with one learned
        scalar ``g`` (an all-zero row gives 0).
    use_simple_rmsnorm: every norm is x-transformers' ``SimpleRMSNorm``: ``x / ||x|| * sqrt(c)``, no parameter.
    disable_abs_pos_emb: whether a wrapper leaves out its absolute position embedding (x-transformers'; the
        default ``None`` means: with rotary, PoPE or T5's relative bias; ALiBi and the other biases keep it).
    attn_kwargs, ff_kwargs: keywords of every ``Attention`` and every ``FeedForward``. Every keyword-only parameter of
        ``Attention`` (``ATTENTION_FIELDS``: read from its signature, never listed here) is also a stack keyword
        ``attn_<name>`` (x-transformers' prefix: ``attn_laser=True`` is ``attn_kwargs={"laser": True}``) and
        ``cross_attn_<name>`` for the cross-attention blocks only; ``Attention.SELF_ONLY`` stay out of cross-attention.
        The config stores them as ``attn_<name>``. ``ff_kwargs`` takes every parameter of ``FeedForward`` this
        signature does not name as ``ff_<name>`` (``FF_KWARGS``, read from both signatures: ``no_bias``,
        ``relu_squared``, ``solu``, ``post_act_ln``, ``glu_mult_bias``, ``sublayer_dropout``, ``zero_init_output``,
        ``output_proj_depth`` and ``dim_out`` equal to ``dim``), also spelt ``ff_<name>`` (``ff_no_bias=True`` is
        ``ff_kwargs={"no_bias": True}``); see ``FeedForward`` for their meaning. Among ``Attention``'s: ``kv_head_order`` (``"tiled"``, x-transformers'
        grouped-query pairing and the default, or ``"interleaved"``, earlier safeformer's), ``qk_norm_groups`` and
        ``qk_norm_scale``.
    attn_onnxable, verbose: accepted with any value, no effect on the numbers (x-transformers uses them to pick
        ONNX-friendly ops and to print construction warnings).
    Other x-transformers keywords (``xt_defaults.XT_DEFAULT_ONLY``: ``attn_on_attn``, ``attn_value_dim_head``,
        ``attn_project_out``, ...) are accepted at x-transformers' default value, which is what safeformer
        does; any other value is a ``TypeError`` that names the keyword.
    norm_add_unit_offset: the norms' gains (and layerscale's) stored minus 1, as x-transformers' default (``True``;
        weight decay then pulls them towards the identity). The state dict is x-transformers' either way.
    rotary_pos_emb: rotary positions in self-attention.
    rotary_emb_dim: features per head that rotate (default ``dim_head // 2``).
    rotary_theta: rotary base.
    rotary_interpolation_factor: positions are divided by it (x-transformers' name; at least 1).
    rotary_base_rescale_factor: the base times ``factor ** (d_rot / (d_rot - 2))`` (NTK-aware scaling,
        x-transformers' name).
    alibi_pos_bias: ALiBi bias in self-attention.
    attn_qk_norm: x-transformers' qk-norm: queries and keys L2-normalised per head (per group of
        ``attn_qk_norm_groups``), the logits scaled by ``attn_qk_norm_scale`` (default 10).
    attn_dropout: attention dropout.
    ff_dropout: feed-forward dropout.
    attn_bias: biases in the attention projections.
    backend: ``attend`` backend for every attention.
    use_adaptive_layernorm: every norm is an adaptive LayerNorm (DiT's AdaLN) driven by a
        per-sample ``condition (b, dim_condition)`` passed to ``forward``.
    use_adaptive_rmsnorm: the same with RMSNorm.
    use_adaptive_layerscale: gate each residual branch by the condition (AdaLN-zero style).
    dim_condition: K, the condition's width (default ``dim``).
    adaptive_null: what a dropped condition becomes (``condition_mask`` False, or no condition): ``"zeros"``
        (the default: no parameter, so the state dict is x-transformers') or ``"learned"`` (a learned
        ``null_condition``, trained with CFG dropping).
    layer_dropout: during training, each residual branch of each sample is skipped with this
        probability (stochastic depth); 0 at evaluation.
    cross_attn_tokens_dropout: during training, each context token is dropped (masked) with this
        probability, per sample; a sample may lose every token (a dead row: safe, adds exactly 0).
    unpadded: run norms, projections, feed-forward and residuals on the real tokens only (packed),
        attention on the padded layout: ``True``, ``False`` or ``"auto"`` (when at least
        ``UNPADDED_THRESHOLD`` of the positions are padding, in a forward without a cache). Costs one
        host sync (the size of the gather); results equal the padded path to the dtype's tolerance.
    attn_num_mem_kv: learned memory key/value pairs per attention block (self and cross), seen by
        every query (see ``Attention(num_mem_kv=...)``); with them no row is dead.
    attn_head_learned_sink: a learned per-head attention sink (``Attention(learned_sink=True)``).
    attn_softclamp_logits: softclamp the attention logits (ALiBi bias included), ``tanh(l / v) * v``
        with ``v = attn_logit_softclamp_value`` (explicit float32 attention, no fused kernel).
    attn_qk_norm_eps: the floor of the q/k L2 norms of ``attn_qk_norm`` (default 1e-12, x-transformers'), and the
        epsilon of ``attn_value_rmsnorm`` (default 1e-6).
    attn_gate_values, attn_gate_values_rank, attn_gate_values_headwise, attn_output_gate,
        attn_output_gate_rank, attn_output_gate_headwise, attn_swiglu_values, attn_low_rank_silu_gates:
        gated attention in every attention block (``Attention(gate_values=..., ...)``, x-transformers'
        names).
    attn_qk_norm_dim_scale: with ``attn_qk_norm``, learned scales per head and feature
        (``qk_norm_q_scale (h, 1, d)``, ``qk_norm_k_scale (h_kv, 1, d)``, ``d ** 0.25`` at init) and the ordinary
        ``d ** -0.5`` logit scale (x-transformers': logits ``sum_e qhat_e khat_e`` at init).
    attn_value_rmsnorm: RMS-normalise each value head, gain ``1 + w`` per key/value head (x-transformers'
        ``MultiheadRMSNorm``; memory values are not normalised, as there).
    add_value_residual: every attention after the first of its kind (self or cross) mixes the first one's
        values into its own, ``lerp(v_first, v, mix)`` (x-transformers' name, ResFormer); ``mix`` is
        ``sigmoid(Linear(x))`` per position and head in self-attention (``learned_value_residual_mix``,
        default True, as there), 0.5 otherwise. Padded path only, no static decode step; not with
        ``attn_value_rmsnorm`` or ``checkpoint_layers``.
    learned_value_residual_mix: see ``add_value_residual``.
    ff_softclamp_value: softclamp the feed-forward's hidden layer before its activation (``FeedForward``).
    rotary_xpos, rotary_xpos_scale_base: xpos (x-transformers' names; turns rotary on): queries scaled by
        ``s ** ((t - c) / scale_base)`` and keys by its inverse after the rotation, ``s = (2k + 0.4 d_rot) /
        (1.4 d_rot)`` per pair ``k``, ``c`` the middle of each sample's positions, so logits decay as ``s ** ((t_i -
        t_j) / scale_base)``. Causal stacks only; padded path, no KV cache (decoding re-encodes; the center moves
        with the sequence), no static step; a sequence whose scales would overflow the dtype is refused.
    use_dynamic_tanh, dynamic_tanh_init_alpha: every norm (the final one too) is ``DynamicTanh``:
        ``tanh(a * x) * gamma + beta`` with a learned scalar ``a`` starting at ``dynamic_tanh_init_alpha``.
    attn_data_dependent_alibi, attn_data_dependent_alibi_kwargs: x-transformers' forgetting-transformer bias in
        self-attention: per position and head a log forget gate ``logsigmoid(Linear(x))`` (bias ``bias_init``,
        default 5, times ``post_log_scale``), summed between key and query (two gates, one per direction,
        without ``causal``); masked positions add nothing. Padded path only, no KV cache (decode with
        ``cache_kv=False``); not with ``alibi_pos_bias``.
    attn_orthog_projected_values, attn_orthog_projected_values_per_head: self-attention's output minus its
        projection onto the sequence's own values, over the whole sample (x-transformers' "belief
        attention"; both: the two copies concatenated into ``to_out``). Masked positions add nothing;
        padded path only, and no KV cache (decode with ``cache_kv=False``).
    cross_attn_kwargs: keywords of ``Attention`` for the cross-attention blocks only, over the shared ones
        (x-transformers' per-kind spelling: ``cross_attn_num_mem_kv=4`` is ``cross_attn_kwargs={"num_mem_kv": 4}``;
        every ``cross_attn_<keyword>`` with ``<keyword>`` an ``Attention`` keyword is read so).
    use_derf: every norm (the final one too) is ``Derf``: ``erf(alpha * x + s) * gamma + beta`` (x-transformers'
        name; learned scalars ``alpha`` from 0.5 and ``s`` from 0).
    adaptive_condition_mlp, adaptive_condition_mlp_expansion: with adaptive norms / layerscale, the condition
        (nulls selected in first) passes ``SiLU(Linear(K, K * expansion, bias=False))`` before every adaptive layer,
        which then reads ``K * expansion`` features (x-transformers' names; ``adaptive_mlp``). A KV cache keeps the
        transformed condition.
    ff_custom_activation: the feed-forward's activation (a module, deep-copied per layer, or a function) instead
        of GELU / SiLU (x-transformers' name); it must map finite inputs to finite outputs.
    ff_glu_softclamp, ff_glu_gate_softclamp_value, ff_glu_up_softclamp_value: situ-GLU (x-transformers' names):
        with ``ff_glu``, the gate is ``softclamp(gate, 4) * Phi(gate)`` (``sigmoid`` with ``ff_swish``) and the up
        branch ``softclamp(up, 25)``, or the values given. The values without ``ff_glu_softclamp``, and
        ``ff_softclamp_value`` with ``ff_glu``, do nothing (as in x-transformers), with a ``UserWarning``.
    polar_pos_emb, polar_bias_uniform_init: PoPE in self-attention (x-transformers' names, ``PolarEmbedding``):
        queries and keys become ``softplus(t) (cos f, sin f)`` (``2 d`` features, values keep ``d``; logits still
        scaled by ``d ** -0.5``), keys' angles plus a learned per-head bias in ``[-2 pi, 0]`` shared by the layers
        (``polar_pos_emb.learned_bias``; uniform in that range at init with ``polar_bias_uniform_init``).
        Positions count real tokens and continue through the KV cache. Not with rotary, grouped-query heads or
        cross-attention positions; padded path only, no static decode step.
    alibi_num_heads: with ``alibi_pos_bias``, ALiBi on the first ``alibi_num_heads`` heads only (the others get
        no bias; x-transformers' name).
    rel_pos_bias, rel_pos_num_buckets, rel_pos_max_distance: T5's bucketed relative position bias in self-attention
        (``RelativePositionBias``, x-transformers' names and scale ``dim_head ** 0.5``), from the positions of the
        real tokens; works with the KV cache and the unpadded path; not with ALiBi.
    rotate_num_heads: rotary positions on the last that many heads of every self-attention only (x-transformers'
        keyword; see ``Attention(rotate_num_heads=...)``); needs ``rotary_pos_emb``. The dynamic KV path.
    dynamic_pos_bias, dynamic_pos_bias_log_distance, dynamic_pos_bias_mlp_depth, dynamic_pos_bias_norm:
        x-transformers' dynamic position bias in self-attention: an MLP (width ``dim // 4``, ``mlp_depth`` SiLU
        layers, with a LayerNorm each with ``norm``) of the distance ``q - k`` (``sign * log(1 + |q - k|)`` with
        ``log_distance``) to one bias per head; distances count real tokens, so left padding shifts nothing.
        The absolute position embedding stays, as in x-transformers. Dynamic KV path (no static step).
    rel_pos_kwargs: with ``alibi_pos_bias``, ``dict(slopes=[...])``: one finite non-negative slope per ALiBi head
        instead of the geometric ones (x-transformers' name; its other relative-position schemes' keywords are
        refused). ``forward(pos=...)`` may then give positions per head, ``(b, h, n)``, as x-transformers'
        custom ALiBi positions (padded path, no KV cache).
    attn_hybrid_module, attn_hybrid_fold_axial_dim, attn_hybrid_mask_kwarg, attn_hybrid_learned_mix: a user's
        sequence module (e.g. ``GRU(dim, heads * dim_head, batch_first=True)``, deep-copied per layer) beside every
        self-attention; both outputs RMS-normalised per head and averaged (or mixed by a learned gate) before
        ``to_out`` (x-transformers' names). The module reads each sample's real tokens moved to the front (padding
        as 0 after them): a ``torch.nn`` GRU / LSTM / RNN runs on them packed (exact per sample, bidirectional
        too; one host sync), another module must be causal or take the mask (``attn_hybrid_mask_kwarg``). A
        unidirectional ``torch.nn`` RNN with fold 1 carries its state in the KV cache; other modules refuse a
        cache. Padded path only (the static decode step runs a cacheable RNN, its state kept in the static cache), not
        with cross-attention (see ``hybrid.py``). The module
        reads padding only: an ``attn_mask`` does not reach it (a causal module sees every earlier real position).
    attn_l2_distance: logits ``-|q - k|^2 * scale`` instead of ``q . k * scale`` (every attention).
    attn_cog_signed: cog attention: softmax of ``|logits|``, the weights given back the logits' signs
        (negative weights).
    attn_sigmoid: weights ``sigmoid(logits)`` (unnormalised; ``cross_attn_sigmoid``: cross-attention only).
    attn_gumbel_softmax, attn_gumbel_softmax_temp, attn_gumbel_softmax_hard: weights sampled by a gumbel softmax
        (hard: one key per query, straight-through gradient); stochastic in evaluation too, as x-transformers.
    attn_laser, attn_laser_softclamp_value: LASER attention, ``log(weights @ exp(softclamp(v)))``.
    attn_use_latent_q, attn_dim_latent_q, attn_use_latent_kv, attn_dim_latent_kv, attn_latent_rope_subheads:
        multi-latent attention (queries and/or keys and values from a bias-less latent of the input; the last
        ``attn_latent_rope_subheads`` key heads from the input itself, the only heads ``rotary_pos_emb`` rotates).
    attn_use_cope, attn_cope_max_pos: contextual positions (CoPE) in causal self-attention: a key's position is
        the sum of ``sigmoid(logit)`` over the visible keys from it to the query; masked keys count 0
        (``attn_cope_soft_onehot_pos=True`` is refused).
    attn_use_rel_proj_pos_bias, attn_rel_proj_num_distance_basis, attn_rel_proj_max_dist: a relative position
        bias in self-attention from learned distance curves mixed per query and head
        (``RelativeProjPositionalBias``), at the real tokens' positions (padding adds no distance).
    cross_attn_inverted_attention: inverted cross-attention: each context key's weights are a softmax over the
        queries (padded queries take none), then each query's weights are L1-normalised over its keys (masked
        keys 0; a dropped context gives exactly 0). A bool, or a tuple of one per cross-attention block. Not in a
        causal stack, no KV cache for the context.
        The options from ``attn_cog_signed`` to ``attn_use_cope`` and ``cross_attn_inverted_attention`` run the
        explicit float32 attention (no fused kernel); they and ``attn_l2_distance`` (fused kernels, through
        ``[2q, 1] . [k, -|k|^2]``) run on the padded path, without the static decode step.
    pre_norm_has_final_norm: end with the final norm (x-transformers' name; ``False`` leaves the
        stream as the last residual left it, as ``TransformerBlock`` does by default).
    ff_mult, attn_dropout, ff_dropout: a number, or a sequence of ``depth`` numbers, one per layer (see
        ``layer_schedule``); a sequence of ``attn_dropout`` sets the self-attentions (cross-attentions then
        take 0, as in x-transformers: ``cross_attn_dropout`` sets them; with ``only_cross`` it sets them).
    num_residual_streams: S > 1: dynamic hyper-connections, S residual streams ``x + stream_emb`` mixed per token
        by each block (a doubly stochastic S x S Sinkhorn matrix; x-transformers 2.31.10 normalises each
        stream's row alone, which makes its mix the all-ones matrix) and summed before the final norm
        (``block.HyperConnection``). 1: one stream, the plain residual.
    hyper_conn_sinkhorn_iters: Sinkhorn-Knopp rounds of the hyper-connections' mixing matrix.
    qkv_receive_diff_residuals: self-attention reads its queries, keys and values from three different
        mixtures of the streams (needs ``num_residual_streams > 1`` or ``integrate_layers``).
    integrate_layers: LIMe: each block's input is a per-token softmax mixture of the inputs of every block so
        far (``block.DynamicLIMe``; ``layer_integrate_use_softmax=False``: ReLU weights); self-attention after
        the first takes three mixtures (queries, keys, values).
    attn_aggregated_residuals: each block's input is an attention, per token, over the inputs of every block run so
        far (``block.AttentionResidual``: the query is the latest input plus a low-rank delta of it, the keys the
        RMS-normed inputs, softmax over them); self-attention takes three (queries, keys, values) with
        ``qkv_receive_diff_residuals``. Branch outputs are never scaled with it (a float ``scale_residual`` /
        ``depth_scale_residual`` is refused: x-transformers ignores them there); not with ``integrate_layers``.
        ``attn_aggregated_residual_kwargs``: ``lora_rank`` (the delta's rank, default 64, below ``dim``) and
        ``lora_activation`` (a callable between its projections, or None).
    gated_multi_residual: ``num_residual_streams`` streams (1 allowed; ``x + stream_emb`` when more), each block
        reading ``sum_s sigmoid(gate_s) * RMSNorm(stream_s) * gain_s / S`` (an elementwise gate, static plus
        low-rank dynamic) and each stream taking the branch output times its own write gate (``2 sigmoid``);
        the streams are not mixed (``block.GatedMultiResidual``). As in x-transformers the blocks then have no
        pre-norm, the streams are normed after every block and the final norm is kept (not with
        ``sandwich_norm``, ``use_dynamic_tanh``, ``pre_norm_has_final_norm=False``, ``scale_residual`` /
        ``scale_residual_constant``, or hyper-connections). ``residual_fn_kwargs=dict(read_gate_rank=r)``
        (required): the rank of the gates' bottleneck. Both options are per token: padded path, KV cache, no
        static decode step.
    unet_skips: U-Net skips: the first block of each layer of the latter half replaces the stream by
        ``Linear([stream entering its mirror layer, stream])`` (x-transformers' pairing).
    reinject_input: every block's input gets ``Linear(x_in)`` of the stack's input added (a learned gate
        ``sigmoid(Linear(x_in))`` with ``learned_reinject_input_gate``); not with ``num_residual_streams > 1``.
    pre_and_post_norm: a norm of the stream after every residual update as well as the pre-norm; no final norm.
    orthog_residual: the stream gains only the part of each branch output orthogonal to it, over each sample's
        real positions and features (float64).
    mv_split_residual: ``stream + (out - mean(out)) * beta + (mean(out) - mean(stream)) * alpha``, means over
        each sample's real positions (``residual_fn_kwargs``: ``learned``, ``init_alpha``, ``init_beta``;
        ``read_gate_rank`` for ``gated_multi_residual``).
        ``orthog_residual`` and ``mv_split_residual`` reduce over the whole sample, as in x-transformers (in a
        causal stack a position's update reads later positions too): no KV cache (``can_cache_kv`` False).
        These residual options run on the padded path and not on the static decode step; padding never
        reaches a real position (masked positions are selected away before every reduction).
    custom_layers: the blocks in order, a tuple of ``'a'`` (self-attention), ``'c'`` (cross-attention, needs
        ``cross_attend``) and ``'f'`` (feed-forward), instead of ``depth`` layers (``depth`` optional then; a
        number per layer, as ``ff_mult=(...)``, is refused).
    par_ratio: x-transformers' sandwich-free PAR layout (https://arxiv.org/abs/2009.04534): the attention
        blocks of ``depth`` layers gathered at the bottom, each followed by feed-forwards, the rest feed-forwards.
    sandwich_coef: the sandwich layout (https://arxiv.org/abs/1911.03864): ``sandwich_coef`` attention blocks
        first, ``depth - sandwich_coef`` ordinary layers, ``sandwich_coef`` feed-forwards last.
    macaron: every layer is ``ff, attention(s), ff``, each feed-forward a half step (its output times 0.5; with
        ``custom_layers`` / ``par_ratio`` / ``sandwich_coef`` every feed-forward is a half step, as x-transformers).
    only_attn: no feed-forward blocks (not with ``layers_execute_order``, ``unet_skips`` or an ``'f'`` in
        ``custom_layers``).
    weight_tie_layers: one layer's blocks run ``depth`` times (x-transformers' ``layers_execute_order``
        ``tuple(range(len_block)) * depth``); ``layers_execute_order``: the blocks' indices in the order every
        forward runs them. Both run on the padded path, off the static decode step; the KV cache holds one entry
        per attention block run.
    pre_norm: ``False``: post-norm, a norm of the stream after every residual update and no pre-norm or
        final norm (not with ``sandwich_norm``).
    sandwich_norm: a norm of each branch output too, before it joins the stream.
    scale_residual, scale_residual_constant: the stream is scaled before a branch is added, per feature by a
        learned scale from 1 (``scale_residual=True``) and by the constant; a float ``scale_residual`` also
        scales every branch output by it, as x-transformers.
    depth_scale_residual: ``True``: each branch's output projection initialised with std ``(2 fan_in
        layer) ** -0.5`` (layer counted from 1); a float: every branch output times it.
    gate_residual: a ``GRUCell`` per block updates the stream (input: the branch output, state: the stream).
    use_layerscale, layerscale_init_value: every branch output times a learned per-feature gain starting at
        the value (``block.LayerScale``; not with ``use_adaptive_layerscale``).
    zero_init_branch_output: every attention's and feed-forward's output projection starts at zero.
    softclamp_output, softclamp_output_value: ``tanh(x / v) * v`` of the stream before the final norm.
    shift_tokens: token shifting (https://github.com/BlinkDL/RWKV-LM): an int ``k`` (or one per block), the
        normed input's features split in segments shifted ``0..k`` positions later (``-k..k`` without
        ``causal``), over each sample's real tokens (padding skipped, as in the sample alone; x-transformers
        reads 0 from padding between real tokens). No KV cache, padded path only, no static step.
        The options from ``custom_layers`` to ``only_attn``, ``sandwich_norm``, ``use_layerscale``, the float
        scales and the inits also run on the unpadded path and the static decode step;
        ``pre_norm=False``, ``scale_residual``, ``scale_residual_constant``, ``gate_residual`` and
        ``softclamp_output`` run in the residual routing (padded path, no static step).
    residual_attn, cross_residual_attn: residual attention (RealFormer, https://arxiv.org/abs/2012.11747): each
        self- (cross-) attention adds the logits of the one before to its own scaled logits, before the bias
        (x-transformers' order: the carried logits hold the bias and the clamp of the layers before). Masked
        keys and dead rows carry nothing (selected to 0). Explicit float32 attention (no fused kernel); decodes
        with the KV cache; padded path only, no static step, not with ``checkpoint_layers``.
    checkpoint_layers: activation checkpointing: during training, each block (its norm, attention
        or feed-forward, and gate) keeps no activations and is recomputed in the backward pass
        (``torch.utils.checkpoint``, non-reentrant, RNG state preserved): identical gradients,
        lower peak memory, about one more forward of compute.

``AttentionLayers.forward``'s keywords:

Args:
    x: ``(b, n, c)``.
    mask: ``(b, n)`` padding of ``x`` (True = real). Padded positions are selected to 0 at the
        input and never reach another position.
    context: ``(b, j, c_ctx)`` for cross-attention, or ``None`` to skip the cross-attention
        blocks for the whole batch. ``j`` may be 0.
    context_mask: ``(b, j)`` padding of the context; an all-False row drops the condition
        of that sample exactly (its cross-attention adds exactly 0).
    attn_mask: an extra self-attention mask ``(b, n, p + n)``, ``(n, p + n)`` or, per head as
        x-transformers passes it, ``(b|1, h|1, n, p + n)`` (True = may attend). A 3-d mask is per sample
        here (x-transformers reads a 3-d mask as ``(h, i, j)``: pass 4-d masks to mean per head).
    positions: ``(b, n)``, ``(1, n)`` or ``(n,)`` integer token positions (for rotary and
        ALiBi); by default the count of real tokens (see ``positions_from_mask``), continuing
        from the cache.
    condition: ``(b, K)`` for adaptive norms / layerscale (``use_adaptive_*``); ``None`` is the
        null condition for every sample.
    condition_mask: ``(b,)`` bool, False = this sample's condition is dropped (the null
        condition replaces it, whatever the row holds: NaN included).
    cache: a ``KVCache`` from an earlier call: ``x`` holds only the new positions; or
        (x-transformers' protocol) the ``LayerIntermediates`` an earlier ``return_hiddens=True`` call
        returned: ``x`` (and ``mask``, ``positions``) then holds the whole sequence so far or only the
        new positions, the last ``cache_age`` (default 1) being new; only those are computed and
        returned. The ``KVCache`` stays the canonical form (the intermediates carry one). The cache
        keeps the context (its keys/values and ``context_mask``) and the condition of the call
        that built it; they may be passed again only as the very same tensors (else
        ``ValueError``).
    return_cache: also return the updated cache.
    pos: x-transformers' name for ``positions``.
    context_pos: ``(b, j)``, ``(1, j)`` or ``(j,)`` integer positions of the context (x-transformers'
        keyword): cross-attention then rotates its queries by the tokens' positions and its keys by
        these (``rotary_pos_emb`` needed). Padded path, no KV cache.
    unpadded_plan: the ``plan_unpadded`` of this call (a wrapper computes it once to run its output
        head on the same real tokens); by default the stack plans itself.
    causal: override the stack's causality for this call (x-transformers' ``forward(causal=...)``;
        ``None``: the stack's own). An override runs the padded path, not with a KV cache, and not with
        ``attn_data_dependent_alibi`` (its gates are built for one direction or two).
    ff_deep_embeds: ``(b, n, L, c)`` multipliers of the ``L`` feed-forward blocks' outputs, per position
        (``TransformerWrapper(ff_deep_embed=True)`` passes its per-token rows; padded positions'
        multipliers are read as 1). Padded path only.
    deep_embeds_and_ids: x-transformers' form of ``ff_deep_embeds``: ``(embeds (V, L, c), ids (b, n))``,
        read as ``embeds[ids]``.
    self_attn_additional_kv: more keys/values for the self-attention blocks (x-transformers' keyword; e.g.
        a VLM's, for an action model): a list of ``(k, v)`` (each ``(b, h_a, a, d)``, ``h_a`` dividing
        ``heads``) or ``None`` per block, or the ``LayerIntermediates`` of another safeformer model's
        ``return_intermediates`` / ``return_hiddens`` call (its cache's self-attention keys, rotated as
        cached, and values; its padding masks them too; x-transformers' intermediates hold unrotated keys).
        With ``route_additional_kv_to_top`` (default) the last entries go to the top blocks, else the
        first to the first. Every query sees them (see ``Attention(additional_key_values=...)``); the
        cache does not keep them (pass them on every call). Padded path only.
    additional_kv_mask: ``(b, a)`` bool, True = a real added key; masked slots (NaN included) reach no
        output and no gradient. ``detach_additional_kv``: no gradient flows into the added keys/values.
    self_attn_kv_residuals: ``(b|1, n|1, c)`` (the first self-attention block only, as x-transformers) or
        ``(L, b|1, n|1, c)`` (one per block, the first ``L``): added to the normed input of the keys and
        values (x-transformers' keyword, the Free Transformer's latent); padded rows selected away. With
        a cache, for the new positions. ``cross_attn_kv_residuals``: the same for cross-attention,
        ``(L, b, j, c_ctx)`` or ``(b, j, c_ctx)``, added to the context (not with a cached context).
        Padded path only.
    seq_pos_offset: the position of ``x``'s first real token (x-transformers' keyword; the real tokens are
        counted from it); not with ``positions``.
    repeat_blocks: x-transformers' depth extrapolation: ``((start, end), repeats)`` (or a tuple of them; an int
        for ``start == end``) runs the layers ``start..end`` (layer = self [cross] feed-forward) ``repeats``
        times in a row; ``layers_execute_order``: the blocks' indices in the order to run them. Padded path,
        no KV cache (the cache holds one entry per attention block), not with ``integrate_layers``.
    mems: Transformer-XL memories (x-transformers' keyword): one ``(b, m, c)`` tensor per self-attention
        block (the stream that entered it in earlier segments, ``TransformerWrapper(return_mems=True)``'s
        ``intermediates.mems``); each self-attention's keys/values then come from its block's normed memory
        before the sequence's own (x-transformers' math: memory keys at positions ``-m .. -1``, every query
        sees the whole memory). ``mem_masks``: ``None``, one ``(b, m)`` bool (True = a real memory slot) for
        every block, or a list of them per block; masked slots (NaN included) reach no output and no
        gradient. Padded path only; not with a KV cache, ``attn_mask``, ``repeat_blocks`` /
        ``layers_execute_order``, residual routing (hyper-connections), ``shift_tokens``,
        ``add_value_residual`` or ``rotary_xpos``; the returned intermediates carry no cache.
    self_attn_kv_mask: ``(b, p + n)`` bool, True = a key self-attention may read (x-transformers' keyword):
        a key mask beside ``mask`` (which masks queries and keys alike); a query left with no key is a dead
        row (exactly 0). Read as ``attn_mask`` ``(b, 1, n, p + n)``: padded path. Not with x-transformers'
        ``LayerIntermediates`` cache (pass ``attn_mask``).
    seq_start_pos: ``(b,)`` integer: the first real position of each sample (x-transformers' keyword for
        left padding): positions before it are padding, as if ``mask`` were False there.
    input_not_include_cache: with x-transformers' ``LayerIntermediates`` cache, every position of ``x`` is
        new (``cache_age = n``).
    attn_bias: an additive float bias of every self-attention block's logits (x-transformers' keyword), broadcastable
        to ``(b, h, n, p + n)`` (``p`` cached positions or memory slots; memory keys ``attn_num_mem_kv`` take bias 0).
        Masked keys stay masked whatever the bias holds there; a query whose keys all have bias ``-inf`` is a dead
        row (exactly 0; x-transformers gives NaN). Not with ``alibi_pos_bias``, ``rel_pos_bias``,
        ``dynamic_pos_bias`` (x-transformers asserts) or ``attn_data_dependent_alibi`` (x-transformers drops the
        given bias there). Padded path, explicit or masked-kernel attention.
    transform_block_inputs: x-transformers' hook between layers: a callable ``(depth, x) -> x`` or a dict ``{depth:
        x -> x}``, applied to the stream entering layer ``depth`` (2, 3, ...; blocks counted in execution order,
        ``(b S, n, c)`` with several residual streams). The hook sees padded positions as exact zeros and its
        result's padded positions are selected to 0 (a hook that mixes positions reads those zeros where
        x-transformers reads its padded stream). Padded path.
    rotary_pos_emb: x-transformers' ``(freqs, xpos_scale)`` (``RotaryEmbedding.forward``'s form: ``freqs (b|1, N,
        d_rot)`` or ``(N, d_rot)``, the last ``n`` rows used; ``xpos_scale`` 1, ``None`` or ``(b|1, N, d_rot)``
        positive scales of the queries, their inverse scaling the keys): the rotary positions of every
        self-attention, in place of the stack's own (with or without ``rotary_pos_emb=True``; cross-attention with
        ``context_pos`` rotates its queries with them). Angles at padded positions are never read. Padded path, no
        KV cache (the returned intermediates carry none), no ``mems``, not with ``polar_pos_emb``.
    in_attn_cond: x-transformers' in-attention conditioning: ``(b, c)`` or ``(b|1, n|1, c)`` added to the input of
        every block's branch (after its residual is taken, before its pre-norm; the stream itself is not changed).
        Padded positions are never read. Padded path; not with ``reinject_input`` (x-transformers asserts).
    return_gumbel_log_probs: return the ``LayerIntermediates`` (as ``return_hiddens``) with each attention
        intermediate's ``log_probs (b, h, i)``: the log probability, under the softmax of its logits, of the key each
        query picked (the arg-max of its weights; meant for ``attn_gumbel_softmax``'s hard picks;
        ``log_prob_from_hard_attend``). Padded queries and dead rows pick nothing: 0.
    polar_pos_emb: x-transformers' PoPE angles ``(freqs, bias)`` as ``PolarEmbedding.forward`` returns them
        (``freqs (1, N, d)``, the last ``n`` rows used; ``bias`` broadcasting to ``(h, N, d)``, the keys' extra
        angles ``freqs + bias``): PoPE in every self-attention, in place of the stack's own (with or without
        ``polar_pos_emb=True``). Angles at padded positions are never read; a non-finite one at a real position is
        a ``ValueError``. Padded path, no KV cache (the returned intermediates carry none), no ``mems`` or extra
        keys/values, not with rotary positions (x-transformers would apply both), memory keys, l2-distance
        attention or ``qk_norm``'s fixed scale; a per-sample ``freqs (b > 1, N, d)`` is refused (x-transformers
        broadcasts it against the heads).
    flash_pack_seq_kwargs: x-transformers' packed documents of self-attention (a stack built with
        ``attn_flash_pack_seq=True``; flash-attn's ``cu_seqlens_q`` / ``cu_seqlens_k``, ``max_seqlen_q`` /
        ``max_seqlen_k``): ``x`` of batch 1 holds several documents, each query seeing its own document's keys
        (causally in a causal stack), a position after the last document none (its attention output is 0). Not
        with ``mask``, ``attn_mask`` or a cache.
    flash_pack_seq_context_kwargs: the same for cross-attention: ``cu_seqlens_q`` the documents of ``x``,
        ``cu_seqlens_k`` those of the context (batch 1, as many), query document ``d`` seeing context document
        ``d`` only. Not with ``context_mask`` (x-transformers asserts) or a cache; padded path.
    return_hiddens: also return a ``LayerIntermediates``: the residual stream entering each
        layer, the attention weights of every attention block (explicit float32 attention:
        slower, ``(b, h, i, j)`` memory), the final hidden states, (x-transformers'
        ``layer_hiddens``) the input of every block run, then the stream before the final norm, and (its
        ``block_hiddens``) the stream at the end of each default block (``(b S, n, c)`` with several residual
        streams), the last one the output after the final norm.
        Padded positions, dead rows and masked keys are exactly 0 in all of them.

Returns:
    ``(b, n, c)`` hidden states after the final norm, then the cache if ``return_cache``, then the ``LayerIntermediates`` if ``return_hiddens``.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.cache import AttnIntermediate, KVCache, LayerIntermediates
from ..core.masks import causal_mask, checked_once, packed_sequence_mask, validate_mask
from ..core.static_cache import StaticKVCache
from ..core.xt_defaults import XT_DEFAULT_ONLY, default_only
from ..nn.attention import Attention
from ..nn.attention_config import HINTS as ATTENTION_HINTS
from ..nn.attention_config import AttentionConfig
from ..nn.block import AdaptiveLayerScale, Block, ResidualRouting, ShiftTokens
from ..nn.modules import (
    AdaptiveNorm,
    Derf,
    DynamicTanh,
    FeedForward,
    PolarEmbedding,
    RotaryEmbedding,
    make_norm,
    stack_alibi_slopes,
)
from ..nn.options import OptionTypeError
from ..nn.relative_position import RelativePositionBias
from ..nn.xt_modules import LayerScale, Residual, Scale
from .decode_step import check_step_call, stack_step
from .stack_forward import (  # noqa: F401 (the forward's inputs and helpers other modules import from here)
    CrossAttentionInputs,
    SelfAttentionInputs,
    StackCall,
    _last,
    check_inputs,
    cross_attention_inputs,
    finish_call,
    mems_unsupported,
    packed_context_mask,
    resolve_call,
    run_blocks,
    self_attention_inputs,
    share_inputs,
)
from .stack_forward import _check_ff_deep_embeds as check_ff_deep_embeds
from .unpadded import UNPADDED_THRESHOLD, UnpaddedPlan, forward_unpadded, plan_unpadded

__all__ = ["KVCache", "LayerIntermediates", "AttnIntermediate", "AttentionLayers", "Encoder", "Decoder", "CrossAttender",
           "layer_schedule",
           "PrefixDecoder", "TransformerBlock", "UNPADDED_THRESHOLD"]


# x-transformers' spelling -> safeformer's name (or a function of the value giving {name: value}); None:
# accepted and ignored (what it chose is automatic here). The README's "Moving from x-transformers" table
# lists them. Only options safeformer supports are here: anything else is an unknown keyword.
def _into(family: str, key: str) -> Callable[[object], dict]:
    """x-transformers' ``attn_<key>`` / ``ff_<key>``: the ``key`` keyword of every ``Attention`` / ``FeedForward``
    of the stack, gathered into ``attn_kwargs`` / ``ff_kwargs``."""
    return lambda v: {family: {key: v}}


# Attention's keywords the stack sets itself on each block: its width, heads, causality and per-layer values
_STACK_SETS = frozenset({"kv_heads", "one_kv_head", "dropout", "backend", "learned_value_residual_mix",
                         "inverted_attention", "rotate_num_heads", "qkv_receive_diff_residuals"})


def _attention_fields() -> dict[str, inspect.Parameter]:
    """The attention family's fields: ``Attention``'s keyword-only parameters the stack hands on unchanged to every
    attention block (``attn_<field>`` at the stack; x-transformers' prefix routing, read from the signature)."""
    params = inspect.signature(Attention.__init__).parameters
    return {n: p for n, p in params.items() if p.kind == p.KEYWORD_ONLY and n not in _STACK_SETS}


ATTENTION_FIELDS = _attention_fields()

LAYER_ALIASES: dict[str, object] = {
    "attn_dim_head": "dim_head",
    "attn_kv_heads": "kv_heads",
    "attn_one_kv_head": lambda v: {"kv_heads": 1} if v else {},
    "cross_attn_dim_context": "dim_context",
    "attn_flash": None,
    # accepted with any value, no effect on the numbers: x-transformers' ONNX-friendly ops, its construction messages
    "attn_onnxable": None,
    "verbose": None,
    # x-transformers' stack drops attn_inverted_attention (inverted attention is cross_attn_inverted_attention)
    "attn_inverted_attention": lambda v: _xt_drops("attn_inverted_attention", v, "cross_attn_inverted_attention"),
    **{f"attn_{k}": _into("attn_kwargs", k) for k in ATTENTION_FIELDS},
    **{k: default_only(k, v) for k, v in XT_DEFAULT_ONLY.items()},
}


_DEFAULT = object()


def packed_stack_mask(stack, x: Tensor, mask, attn_mask, cache, kwargs) -> Tensor:
    """x-transformers' ``flash_pack_seq_kwargs`` (flash-attn's ``cu_seqlens_q`` / ``cu_seqlens_k``) of a stack built
    with ``attn_flash_pack_seq=True``: one sequence of packed documents as the ``attn_mask (1, 1, n, n)`` of every
    self-attention (each query sees its own document; positions after the last one see nothing)."""
    blocks = [blk.mixer for blk in stack.layers if blk.kind == "self"]
    if not blocks or not all(m.flash_pack_seq for m in blocks):
        raise TypeError("flash_pack_seq_kwargs needs a stack built with attn_flash_pack_seq=True")
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != 1 or any(m is not None for m in (mask, attn_mask,
                                                                                                  cache)):
        raise ValueError("flash_pack_seq_kwargs describe one packed sequence (x of batch 1): not with mask, "
                         "attn_mask or a cache (x-transformers asserts the same)")
    return packed_sequence_mask(kwargs, x.shape[1], x.shape[1], x.device)


def _xt_drops(name: str, value, instead: str) -> dict:
    """A keyword x-transformers' stack accepts and drops: accepted with any value, no effect (as there), a warning
    naming what does it when it is set."""
    if value not in (False, None):
        warnings.warn(f"{name}={value!r} has no effect: x-transformers' stack drops it, and so does safeformer's "
                      f"(use {instead})", UserWarning, stacklevel=4)
    return {}


def owner_cls(owner: str):
    from ..checkpoints.pretrained import _REGISTRY

    return _REGISTRY.get(owner, AttentionLayers)


def _defaults(cls) -> dict:
    import inspect

    for klass in cls.__mro__:  # the first __init__ with named parameters (Encoder & co. pass **kwargs on)
        params = inspect.signature(klass.__init__).parameters
        if any(p.kind == p.KEYWORD_ONLY for p in params.values()):
            return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return {}


MODULE_KWARGS = ("attn_kwargs", "ff_kwargs")


def merge_module_kwargs(owner: str, have: dict | None, new: dict, name: str, key: str) -> dict:
    """``have`` (an ``attn_kwargs`` / ``ff_kwargs`` so far) with ``new``'s keywords added, each given once."""
    out = dict(have or {})
    for k, v in new.items():
        if k in out:
            raise TypeError(f"{owner}: {k!r} is given twice, in {name} and as {key!r}")
        out[k] = v
    return out


def translate_aliases(owner: str, given: dict, aliases: dict, table: dict) -> dict:
    """``given`` (the canonical arguments as bound) updated with ``aliases`` translated through ``table``.

    Raises:
        TypeError: an unknown keyword (the closest valid names suggested), or one option given twice
            under two spellings.
    """
    import difflib

    out = dict(given)
    for key, value in aliases.items():
        if key not in table:
            valid = sorted(set(given) | set(table))
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}{hint}")
        target = table[key]
        if target is None:
            continue
        updates = target(value) if callable(target) else {target: value}
        if "_unsupported" in updates:
            raise TypeError(f"{owner}: x-transformers' option {updates['_unsupported']} is not supported by safeformer")
        defaults = _defaults(owner_cls(owner))
        for name, v in updates.items():
            if name in MODULE_KWARGS:  # one keyword of each Attention / FeedForward: merged
                out[name] = merge_module_kwargs(owner, out.get(name), v, name, key)
                continue
            if name in given and given[name] != defaults.get(name, _DEFAULT):  # also set under its own name
                raise TypeError(f"{owner}: {name!r} is given twice, as {name!r} and as {key!r}")
            out[name] = v
    return out


class AttentionLayers(Configurable, nn.Module):
    """A pre-norm stack of attention and feed-forward blocks (x-transformers' ``AttentionLayers``).

    Every keyword is documented in this module's docstring (``help(safeformer.layers)``), x-transformers' names
    included; ``forward`` documents its own. The constructor builds the stack by option family, each family
    checking its own keywords and building its own modules, in this order: ``_basics`` (width, causality,
    cross-attention, the adaptive condition), ``_positions`` (rotary, xpos, PoPE, ALiBi, T5's bias),
    ``_check_attention_options``, ``_layout`` (the blocks' kinds and order), ``_attention_factory`` and ``_norms``
    (what each block holds), ``_blocks`` (the blocks) and ``_routing_and_paths`` (the residual routing, the final
    norm, and which paths and caches the options run on).
    """

    def __init__(
        self,
        *,
        dim: int, depth: int | None = None, heads: int = 8, dim_head: int = 64, kv_heads: int | None = None,
        causal: bool = False, cross_attend: bool = False, only_cross: bool = False, dim_context: int | None = None,
        ff_mult: float | tuple[float, ...] = 4, ff_glu: bool = False, ff_swish: bool = False,
        use_rmsnorm: bool = False, norm_eps: float | None = None, use_scalenorm: bool = False,
        use_simple_rmsnorm: bool = False,
        rotary_pos_emb: bool = False, rotary_emb_dim: int | None = None, rotary_theta: float = 10000.0,
        rotary_interpolation_factor: float = 1.0, rotary_base_rescale_factor: float = 1.0,
        alibi_pos_bias: bool = False,
        attn_dropout: float | tuple[float, ...] = 0.0,
        ff_dropout: float | tuple[float, ...] = 0.0,
        backend: str = "auto",
        use_adaptive_layernorm: bool = False, use_adaptive_rmsnorm: bool = False,
        use_adaptive_layerscale: bool = False, dim_condition: int | None = None, adaptive_null: str = "zeros",
        layer_dropout: float = 0.0, cross_attn_tokens_dropout: float = 0.0,
        checkpoint_layers: bool = False, unpadded: bool | str = "auto",
        pre_norm_has_final_norm: bool = True,
        add_value_residual: bool = False, learned_value_residual_mix: bool = True,
        ff_softclamp_value: float | None = None,
        rotary_xpos: bool = False, rotary_xpos_scale_base: float = 512,
        use_dynamic_tanh: bool = False, dynamic_tanh_init_alpha: float = 1.0,
        alibi_num_heads: int | None = None, rel_pos_kwargs: dict | None = None,
        rel_pos_bias: bool = False, rel_pos_num_buckets: int = 32, rel_pos_max_distance: int = 128,
        polar_pos_emb: bool = False, polar_bias_uniform_init: bool = False,
        use_derf: bool = False,
        adaptive_condition_mlp: bool = False, adaptive_condition_mlp_expansion: int = 4,
        ff_custom_activation=None,
        ff_glu_softclamp: bool = False, ff_glu_gate_softclamp_value: float | None = None,
        ff_glu_up_softclamp_value: float | None = None,
        cross_attn_kwargs: dict | None = None,
        cross_attn_inverted_attention: bool | tuple = False,
        num_residual_streams: int = 1, qkv_receive_diff_residuals: bool = False,
        integrate_layers: bool = False, layer_integrate_use_softmax: bool = True, hyper_conn_sinkhorn_iters: int = 5,
        unet_skips: bool = False,
        reinject_input: bool = False, learned_reinject_input_gate: bool = False,
        pre_and_post_norm: bool = False, orthog_residual: bool = False, mv_split_residual: bool = False,
        residual_fn_kwargs: dict | None = None,
        attn_aggregated_residuals: bool = False, attn_aggregated_residual_kwargs: dict | None = None,
        gated_multi_residual: bool = False,
        custom_layers: tuple[str, ...] | None = None, par_ratio: int | None = None, sandwich_coef: int | None = None,
        macaron: bool = False, only_attn: bool = False,
        weight_tie_layers: bool = False, layers_execute_order: tuple[int, ...] | None = None,
        pre_norm: bool = True, sandwich_norm: bool = False,
        scale_residual: bool | float = False, scale_residual_constant: float = 1.0,
        depth_scale_residual: bool | float = False, gate_residual: bool = False,
        use_layerscale: bool = False, layerscale_init_value: float = 0.0,
        zero_init_branch_output: bool = False,
        softclamp_output: bool = False, softclamp_output_value: float = 30.0,
        shift_tokens: int | tuple[int, ...] = 0,
        residual_attn: bool = False, cross_residual_attn: bool = False,
        disable_abs_pos_emb: bool | None = None, attn_kwargs: dict | None = None, ff_kwargs: dict | None = None,
        dynamic_pos_bias: bool = False, dynamic_pos_bias_log_distance: bool = False,
        dynamic_pos_bias_mlp_depth: int = 2, dynamic_pos_bias_norm: bool = False,
        rotate_num_heads: int | None = None, norm_add_unit_offset: bool = True,
        **aliases,
    ):
        if aliases:  # x-transformers' spellings, through the one explicit table (never prefix routing)
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            aliases, per_kind = _cross_attn_spellings(aliases)  # cross_attn_<Attention keyword>
            if per_kind:
                given["cross_attn_kwargs"] = {**(cross_attn_kwargs or {}), **per_kind}
            AttentionLayers.__init__(self, **translate_aliases(type(self).__name__, given, aliases, LAYER_ALIASES))
            return
        super().__init__()
        self._set_config_from(AttentionLayers.__init__, locals())
        options = _options(self._sf_config)  # every keyword by its own name (each family reads its own)
        _family(_check_options, options)
        _family(_check_residual_kinds, options)
        _family(_basics, options, self)
        _family(_positions, options, self)
        _family(_check_attention_options, options, self)
        layout = _family(_layout, options, self)
        attention = _family(_attention_factory, options, layout)
        norm, cond_width = _family(_norms, options, self)
        shifts = _family(_blocks, options, self, layout, attention, norm, cond_width)
        _family(_routing_and_paths, options, self, layout, norm, shifts)
        self._register_load_state_dict_pre_hook(_legacy_routing_keys)

    @classmethod
    def config_fields(cls) -> dict[str, tuple[inspect.Parameter, object]]:
        """The keywords a saved config may hold beyond the signature: every attention field as ``attn_<field>``
        (x-transformers' spelling; earlier configs stored them so), typed by ``Attention``'s annotations."""
        return {f"attn_{k}": (p.replace(name=f"attn_{k}"), ATTENTION_HINTS.get(k, object))
                for k, p in ATTENTION_FIELDS.items()}

    def attn_qk_clip_(self, intermediates: LayerIntermediates, tau: float = 100.0) -> None:
        """MuonClip's qk-clip for every attention block (x-transformers' ``attn_qk_clip_``): pairs the
        ``attn_intermediates`` of a ``return_hiddens`` / ``return_intermediates`` call, in order, with the attention
        blocks that ran, and calls each block's ``Attention.qk_clip_`` on its ``pre_softmax_attn``.

        Raises:
            ValueError: the intermediates do not match this stack's attention blocks (a call without its context
                skips the cross-attention blocks: clip with the intermediates of a call that ran them all).
        """
        inters = getattr(intermediates, "attn_intermediates", None)
        if inters is None:
            raise ValueError("attn_qk_clip_ takes the LayerIntermediates of a call with return_hiddens=True "
                             "(return_intermediates=True on a wrapper)")
        kinds = {"a": "self", "c": "cross"}
        blocks = [blk for blk in self.layers if blk.kind != "ff"]
        ran = [blk for blk in blocks if blk.kind == "self" or any(t.layer_type == "c" for t in inters)]
        if len(ran) != len(inters) or any(kinds.get(t.layer_type) != blk.kind for t, blk in zip(inters, ran)):
            raise ValueError(f"the intermediates hold {len(inters)} attention blocks' logits, which do not pair with "
                             f"this stack's {len(ran)} attention blocks that ran")
        for blk, inter in zip(ran, inters):
            blk.mixer.qk_clip_(inter, tau=tau)

    def muon_parameters(self) -> list[nn.Parameter]:
        """The matrices Muon should optimise (x-transformers' ``muon_parameters``): each attention's value and output
        projection weights and each feed-forward's linear weights."""
        return [p for m in self.modules() if isinstance(m, (Attention, FeedForward)) for p in m.muon_parameters()]

    @property
    def rotary(self) -> RotaryEmbedding | None:
        """The rotary embedding (x-transformers' ``rotary_pos_emb``), or ``None``."""
        return self.rotary_pos_emb

    @property
    def executed_kinds(self) -> tuple[str, ...]:
        """The blocks' kinds in the order a forward runs them (``weight_tie_layers`` / ``layers_execute_order``
        repeat blocks): a KV cache holds one entry per attention block run."""
        if self.default_order is None:
            return self.layer_kinds
        return tuple(self.layer_kinds[i] for i in self.default_order)

    @property
    def can_cache_kv(self) -> bool:
        """x-transformers' flag: whether a forward may continue from a KV cache (``False`` with a residual option
        that reduces over the whole sample: ``orthog_residual``, ``mv_split_residual``; or ``rotary_xpos``)."""
        if self.rotary is not None and self.rotary.use_xpos or self.cache_refusal is not None:
            return False
        return self.routing is None or not self.routing.sequence_wide

    def plan_unpadded(self, mask: Tensor | None, *, cache=None, return_cache: bool = False,
                      attn_mask: Tensor | None = None, return_hiddens: bool = False) -> UnpaddedPlan | None:
        """Whether (and on which real tokens) ``forward`` runs the unpadded path: see ``unpadded.py``."""
        return plan_unpadded(self.unpadded, mask, packable=self.packable, cache=cache, return_cache=return_cache,
                             attn_mask=attn_mask, return_hiddens=return_hiddens)

    @checked_once
    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, context: Tensor | None = None,
        context_mask: Tensor | None = None, attn_mask: Tensor | None = None, positions: Tensor | None = None,
        condition: Tensor | None = None, condition_mask: Tensor | None = None, cache: KVCache | None = None,
        return_cache: bool = False, return_hiddens: bool = False, pos: Tensor | None = None,
        unpadded_plan: UnpaddedPlan | None = None, cache_age: int = 1, context_pos: Tensor | None = None,
        causal: bool | None = None, ff_deep_embeds: Tensor | None = None,
        deep_embeds_and_ids: tuple[Tensor, Tensor] | None = None, self_attn_additional_kv=None,
        additional_kv_mask: Tensor | None = None, detach_additional_kv: bool = False,
        route_additional_kv_to_top: bool = True, self_attn_kv_residuals: Tensor | None = None,
        cross_attn_kv_residuals: Tensor | None = None, seq_pos_offset: int | None = None, repeat_blocks=None,
        layers_execute_order: tuple[int, ...] | None = None, mems=None, mem_masks=None,
        self_attn_kv_mask: Tensor | None = None, seq_start_pos: Tensor | None = None,
        input_not_include_cache: bool = False, rotary_pos_emb=None, polar_pos_emb=None, attn_bias=None,
        in_attn_cond=None, flash_pack_seq_kwargs=None, flash_pack_seq_context_kwargs=None,
        transform_block_inputs=None, return_gumbel_log_probs: bool = False,
    ) -> Tensor | tuple:
        """Run the stack: ``x (b, n, c)`` -> ``(b, n, c)`` hidden states after the final norm, then the cache if
        ``return_cache``, then the ``LayerIntermediates`` if ``return_hiddens``. Every keyword is x-transformers' (or
        safeformer's beside it) and is documented in this module's docstring (``help(safeformer.stack.layers)``,
        "``AttentionLayers.forward``'s keywords"); the call runs in phases (``stack_forward``: ``resolve_call``,
        ``share_inputs``, ``run_blocks`` or the unpadded path, ``finish_call``)."""
        if type(cache) is StaticKVCache:  # one decode step over preallocated slots (decode_step.py)
            deep = ff_deep_embeds  # the wrapper's ff_deep_embed rows of the new position: (b, 1, L, dim)
            if not torch.compiler.is_compiling():  # the arguments besides x: their defaults (locals(): eager only)
                check_step_call(AttentionLayers.forward, {**locals(), "ff_deep_embeds": None})
                deep = check_ff_deep_embeds(self, deep, x, None)
            out = stack_step(self, x, cache, deep)
            return (out, cache) if return_cache else out
        if flash_pack_seq_kwargs is not None:  # packed documents (attn_flash_pack_seq): a block-diagonal attn_mask
            attn_mask = packed_stack_mask(self, x, mask, attn_mask, cache, flash_pack_seq_kwargs)
        packed_context = None  # packed context documents: a block-diagonal cross-attention mask
        if flash_pack_seq_context_kwargs is not None:
            packed_context = packed_context_mask(self, x, context, context_mask, cache, flash_pack_seq_context_kwargs)
        if not isinstance(return_gumbel_log_probs, bool):
            raise TypeError(f"return_gumbel_log_probs must be True or False, got {return_gumbel_log_probs!r}")
        if not isinstance(input_not_include_cache, bool):
            raise TypeError(f"input_not_include_cache must be True or False, got {input_not_include_cache!r}")
        if input_not_include_cache and isinstance(cache, LayerIntermediates) and cache_age == 1 \
                and isinstance(x, Tensor) and x.dim() == 3:
            cache_age = x.shape[1]  # every position of x is new
        if self_attn_kv_mask is not None or seq_start_pos is not None:
            mask, attn_mask = _xt_key_masks(x, mask, attn_mask, cache, self_attn_kv_mask, seq_start_pos)
        call = StackCall(x=x, mask=mask, context=context, context_mask=context_mask, attn_mask=attn_mask,
                         positions=positions, condition=condition, condition_mask=condition_mask, cache=cache,
                         return_cache=return_cache, return_hiddens=return_hiddens or return_gumbel_log_probs, pos=pos,
                         unpadded_plan=unpadded_plan, cache_age=cache_age, context_pos=context_pos, causal=causal,
                         ff_deep_embeds=ff_deep_embeds, deep_embeds_and_ids=deep_embeds_and_ids,
                         self_attn_additional_kv=self_attn_additional_kv, additional_kv_mask=additional_kv_mask,
                         detach_additional_kv=detach_additional_kv,
                         route_additional_kv_to_top=route_additional_kv_to_top,
                         self_attn_kv_residuals=self_attn_kv_residuals,
                         cross_attn_kv_residuals=cross_attn_kv_residuals, seq_pos_offset=seq_pos_offset,
                         repeat_blocks=repeat_blocks, layers_execute_order=layers_execute_order, mems=mems,
                         mem_masks=mem_masks, attn_bias=attn_bias, transform_block_inputs=transform_block_inputs,
                         rotary_pos_emb=rotary_pos_emb, in_attn_cond=in_attn_cond,
                         gumbel_log_probs=return_gumbel_log_probs, polar_pos_emb=polar_pos_emb,
                         packed_context=packed_context)
        resolved = resolve_call(self, call)  # x-transformers' spellings resolved, every input checked
        shared = share_inputs(self, call, resolved)  # the masks, positions, context and condition every block reads
        if shared.unpadded_plan is not None:  # the real tokens only (unpadded.py)
            return forward_unpadded(self, shared.x, shared.unpadded_plan, shared.positions,
                                    shared.context if shared.ca.used else None, shared.context_mask, shared.cond)
        return finish_call(self, call, resolved, shared, *run_blocks(self, call, resolved, shared))


def _xt_key_masks(x, mask, attn_mask, cache, self_attn_kv_mask, seq_start_pos) -> tuple:
    """x-transformers' ``seq_start_pos`` and ``self_attn_kv_mask`` read as safeformer's ``mask`` and ``attn_mask``."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape (b, n, dim), got {getattr(x, 'shape', type(x))}")
    b, n, device = x.shape[0], x.shape[1], x.device
    if seq_start_pos is not None:
        if not isinstance(seq_start_pos, Tensor) or seq_start_pos.shape != (b,) or seq_start_pos.is_floating_point() \
                or seq_start_pos.is_complex() or seq_start_pos.dtype == torch.bool or seq_start_pos.device != device:
            raise ValueError(f"seq_start_pos must be an integer tensor of shape (b={b},) on {device}, got "
                             f"{getattr(seq_start_pos, 'dtype', type(seq_start_pos).__name__)} "
                             f"{tuple(getattr(seq_start_pos, 'shape', ()))}")
        start = torch.arange(n, device=device)[None] >= seq_start_pos[:, None]  # (b, n): x-transformers' left pad
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=device)
        mask = start if mask is None else mask & start
    if self_attn_kv_mask is not None:
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError("self_attn_kv_mask with x-transformers' LayerIntermediates cache: pass attn_mask "
                             "(b, 1, n, p + n) instead")
        keys = n + (cache.length if cache is not None else 0)
        validate_mask(self_attn_kv_mask, "self_attn_kv_mask", shape=(b, keys), device=device)
        kv = self_attn_kv_mask[:, None, None, :].expand(b, 1, n, keys)
        if attn_mask is not None:
            validate_mask(attn_mask, "attn_mask", device=device)
            if attn_mask.dim() == 3:  # per sample (b, n, p + n) or (n, p + n): see the docstring
                attn_mask = attn_mask[:, None] if attn_mask.shape[0] == b and attn_mask.dim() == 3 else attn_mask
            kv = kv & attn_mask
        attn_mask = kv
    return mask, attn_mask


def _basics(stack: AttentionLayers, *, dim, causal, cross_attend, only_cross, dim_context, unpadded, checkpoint_layers,
            use_adaptive_layernorm, use_adaptive_rmsnorm, use_adaptive_layerscale, dim_condition, adaptive_null,
            layer_dropout, cross_attn_tokens_dropout) -> None:
    """The stack's width, causality and cross-attention, the path options and the adaptive condition (its null
    condition, a learned ``(K,)`` parameter or a zero buffer), set on ``stack`` (checked by ``_check_options``)."""
    stack.unpadded = unpadded
    stack.checkpoint_layers = checkpoint_layers
    stack.adaptive = use_adaptive_layernorm or use_adaptive_rmsnorm or use_adaptive_layerscale
    stack.layer_dropout = float(layer_dropout)
    stack.cross_attn_tokens_dropout = float(cross_attn_tokens_dropout)
    stack.dim_condition = (dim if dim_condition is None else dim_condition) if stack.adaptive else None
    if stack.adaptive and adaptive_null == "learned":
        stack.null_condition = nn.Parameter(torch.zeros(stack.dim_condition))  # (K,)
    elif stack.adaptive:
        stack.register_buffer("null_condition", torch.zeros(stack.dim_condition), persistent=False)
    else:
        stack.null_condition = None
    stack.dim = dim
    stack.causal = causal
    stack.has_cross = cross_attend or only_cross
    stack.only_cross = only_cross
    stack.dim_context = dim if dim_context is None else dim_context


def _positions(stack: AttentionLayers, *, heads, dim_head, kv_heads, causal, rotary_pos_emb, rotary_emb_dim,
               rotary_theta, rotary_interpolation_factor, rotary_base_rescale_factor, rotary_xpos,
               rotary_xpos_scale_base, polar_pos_emb, polar_bias_uniform_init, attn_num_mem_kv, alibi_pos_bias,
               alibi_num_heads, rel_pos_kwargs, rel_pos_bias, rel_pos_num_buckets, rel_pos_max_distance,
               attn_data_dependent_alibi, disable_abs_pos_emb, dynamic_pos_bias, dynamic_pos_bias_log_distance,
               dynamic_pos_bias_mlp_depth, dynamic_pos_bias_norm, dim, attn_l2_distance) -> None:
    """The position schemes of self-attention, checked and set on ``stack``: ``rotary`` (``RotaryEmbedding``, xpos
    included), ``polar_pos_emb`` (PoPE; not with ``attn_l2_distance``), the ``alibi_slopes`` buffer ``(h,)``,
    ``rel_pos`` (T5's bucketed bias) and ``has_relative_positions``."""
    rotary_emb_dim = dim_head // 2 if rotary_emb_dim is None else rotary_emb_dim
    stack.rotary_pos_emb = RotaryEmbedding(rotary_emb_dim, theta=rotary_theta, interpolation_factor=rotary_interpolation_factor,
                                   base_rescale_factor=rotary_base_rescale_factor, use_xpos=rotary_xpos,
                                           scale_base=rotary_xpos_scale_base) if rotary_pos_emb or rotary_xpos else None
    if polar_bias_uniform_init and not polar_pos_emb:
        raise ValueError("polar_bias_uniform_init initialises PoPE's bias: it needs polar_pos_emb=True")
    if polar_pos_emb and (stack.rotary is not None or (kv_heads is not None and kv_heads != heads)
                          or attn_num_mem_kv):
        raise ValueError("polar_pos_emb (PoPE) replaces rotary positions and has one key bias per query head: not "
                         "with rotary_pos_emb / rotary_xpos, grouped-query heads (kv_heads < heads) or "
                         "attn_num_mem_kv (memory keys have d features, PoPE's keys 2 d)")
    if polar_pos_emb and attn_l2_distance:  # the l2 distance of PoPE's 2 d features: not x-transformers' numbers here
        raise ValueError("polar_pos_emb (PoPE) is not supported with attn_l2_distance: safeformer scales PoPE's "
                         "queries, which changes l2 distances (x-transformers' numbers would differ)")
    stack.polar_pos_emb = PolarEmbedding(dim_head, heads, polar_bias_uniform_init) if polar_pos_emb else None
    if (alibi_num_heads is not None or rel_pos_kwargs) and not alibi_pos_bias:
        raise ValueError("alibi_num_heads / rel_pos_kwargs configure ALiBi (the one relative-position bias here): "
                         "they need alibi_pos_bias=True")
    if rel_pos_kwargs and set(rel_pos_kwargs) - {"slopes"}:
        raise ValueError(f"rel_pos_kwargs takes ALiBi's slopes only, got {sorted(rel_pos_kwargs)}")
    if alibi_pos_bias:
        stack.register_buffer("alibi_slopes", stack_alibi_slopes(heads, alibi_num_heads, (rel_pos_kwargs or {}).get(
            "slopes")), persistent=False)
    else:
        stack.alibi_slopes = None
    if sum(map(bool, (rel_pos_bias, alibi_pos_bias or attn_data_dependent_alibi, dynamic_pos_bias))) > 1:
        raise ValueError("choose one relative position bias: rel_pos_bias (T5), dynamic_pos_bias, alibi_pos_bias or "
                         "attn_data_dependent_alibi")
    # T5's bucketed relative position bias in self-attention (x-transformers' scale: dim_head ** 0.5)
    stack.rel_pos = RelativePositionBias(scale=dim_head**0.5, causal=causal, num_buckets=rel_pos_num_buckets,
                                         max_distance=rel_pos_max_distance, heads=heads) if rel_pos_bias else None
    if not dynamic_pos_bias and (dynamic_pos_bias_log_distance or dynamic_pos_bias_norm
                                 or dynamic_pos_bias_mlp_depth != 2):
        raise ValueError("dynamic_pos_bias_log_distance / _mlp_depth / _norm configure dynamic_pos_bias: they need "
                         "dynamic_pos_bias=True")
    if dynamic_pos_bias:  # x-transformers' MLP of the relative distance (its width dim // 4), the stack's rel_pos
        from ..nn.xt_modules import DynamicPositionBias

        stack.rel_pos = DynamicPositionBias(dim // 4, heads=heads, depth=dynamic_pos_bias_mlp_depth,
                                            log_distance=bool(dynamic_pos_bias_log_distance),
                                            norm=bool(dynamic_pos_bias_norm))
    stack.has_relative_positions = rotary_pos_emb or alibi_pos_bias or rotary_xpos or polar_pos_emb or rel_pos_bias
    if disable_abs_pos_emb is not None and not isinstance(disable_abs_pos_emb, bool):
        raise TypeError(f"disable_abs_pos_emb must be True, False or None, got {disable_abs_pos_emb!r}")
    # x-transformers' attribute: whether a wrapper leaves out its absolute position embedding (by default with
    # rotary, PoPE or T5's bias; ALiBi and the other biases keep it, as there)
    stack.disable_abs_pos_emb = bool(rotary_pos_emb or rotary_xpos or polar_pos_emb or rel_pos_bias) \
        if disable_abs_pos_emb is None else disable_abs_pos_emb


def _check_attention_options(stack: AttentionLayers, *, add_value_residual, attn_value_rmsnorm, checkpoint_layers,
                             rotary_xpos, causal, alibi_pos_bias, attn_hybrid_module, cross_attend, only_cross,
                             attn_data_dependent_alibi) -> None:
    """The attention options that must agree with the positions and the stack (sets ``add_value_residual``)."""
    if add_value_residual and (attn_value_rmsnorm or checkpoint_layers):
        raise ValueError("add_value_residual cannot be combined with attn_value_rmsnorm or checkpoint_layers")
    stack.add_value_residual = bool(add_value_residual)
    if not isinstance(rotary_xpos, bool):
        raise TypeError(f"rotary_xpos must be a bool, got {rotary_xpos!r}")
    if rotary_xpos and (not causal or alibi_pos_bias):
        raise ValueError("rotary_xpos decays logits with the distance to past keys: it needs a causal stack "
                         "(Decoder) and no alibi_pos_bias")
    if attn_hybrid_module is not None and (cross_attend or only_cross):
        raise ValueError("attn_hybrid_module runs beside self-attention only (x-transformers would put a copy in "
                         "each cross-attention block too); not with cross_attend / only_cross")
    if attn_data_dependent_alibi and alibi_pos_bias:
        raise ValueError("choose one of alibi_pos_bias and attn_data_dependent_alibi, not both")


@dataclass(frozen=True)
class _Layout:
    """The stack's blocks: their kinds (x-transformers' ``'a'`` / ``'c'`` / ``'f'``), the blocks per default layer,
    the constructor's execution order (``None``: each block once, in order), the number of layers, and the
    per-layer options (a number, or a tuple of one per layer)."""

    types: tuple[str, ...]
    len_block: int
    order: tuple[int, ...] | None
    depth: int
    attn_dropouts: float | tuple[float, ...]
    ff_mults: float | tuple[float, ...]
    ff_dropouts: float | tuple[float, ...]


def _layout(stack: AttentionLayers, *, depth, only_cross, macaron, only_attn, custom_layers, par_ratio, sandwich_coef,
            weight_tie_layers, layers_execute_order, unet_skips, integrate_layers, ff_mult, attn_dropout, ff_dropout) -> _Layout:
    """The layout options checked (``_layer_types``) and the per-layer schedules read: the ``_Layout``."""
    types, len_block, ctor_order, depth = _layer_types(
        depth=depth, cross=stack.has_cross, only_cross=only_cross, macaron=macaron, only_attn=only_attn,
        custom_layers=custom_layers, par_ratio=par_ratio, sandwich_coef=sandwich_coef,
        weight_tie_layers=weight_tie_layers, layers_execute_order=layers_execute_order, unet_skips=unet_skips,
        per_layer=[v for v in (ff_mult, attn_dropout, ff_dropout) if isinstance(v, (tuple, list))])
    if ctor_order is not None and integrate_layers:
        raise ValueError("integrate_layers mixes one input per block: not with weight_tie_layers / "
                         "layers_execute_order")
    attn_dropouts = _per_layer("attn_dropout", attn_dropout, depth)
    ff_mults, ff_dropouts = _per_layer("ff_mult", ff_mult, depth), _per_layer("ff_dropout", ff_dropout, depth)
    return _Layout(types, len_block, ctor_order, depth, attn_dropouts, ff_mults, ff_dropouts)


def _attention_factory(layout: _Layout, *, dim, heads, dim_head, kv_heads, causal, only_cross, backend,
                       add_value_residual, learned_value_residual_mix, cross_attn_kwargs, cross_attn_inverted_attention,
                       rotate_num_heads, attention_fields) -> Callable[[int | None, int], Attention]:
    """The stack's ``attention(context_dim, layer)`` factory: the next attention block's ``Attention``, self-attention
    (``context_dim`` None) or cross-attention (over ``context_dim`` features), of layer ``layer``, with the stack's
    attention fields (``attention_fields``: every ``attn_<field>``; cross-attention leaves out ``Attention.SELF_ONLY``
    and takes ``cross_attn_kwargs`` over them). Blocks are built in order: the factory counts the self-attentions
    (``add_value_residual``) and the cross-attentions (``cross_attn_inverted_attention``, checked here)."""
    first_self = [True]
    given = {k: v for k, v in attention_fields.items() if v is not ATTENTION_FIELDS[k].default}  # the defaults: Attention's
    shared = dict(dim=dim, heads=heads, dim_head=dim_head, kv_heads=kv_heads, backend=backend)
    overrides = dict(cross_attn_kwargs or {})
    inverted = _inverted_per_layer(cross_attn_inverted_attention, layout.types.count("c"), causal)
    # the keywords checked once, into one config per kind (the blocks differ from it by their per-layer values)
    rotate = {} if rotate_num_heads is None else {"rotate_num_heads": rotate_num_heads}
    try:
        self_config = AttentionConfig.from_keywords(**shared, **given, causal=causal, **rotate)
    except OptionTypeError as e:
        raise e.spelt("attn_") from None
    try:
        cross_config = AttentionConfig.from_keywords(**{
            **shared, **{k: v for k, v in given.items() if k not in Attention.SELF_ONLY}, **overrides})
    except OptionTypeError as e:
        raise e.spelt("cross_attn_" if e.name in overrides else "attn_") from None

    def attention_block(context_dim: int | None, layer: int) -> Attention:
        self_attn = context_dim is None
        learned_mix = bool(add_value_residual and learned_value_residual_mix and self_attn
                           and not first_self[0])  # x-transformers: every self-attention but the first
        first_self[0] = first_self[0] and not self_attn
        block = dict(dim_context=context_dim, dropout=_layer_value(layout.attn_dropouts, layer, self_attn or only_cross),
                     learned_value_residual_mix=learned_mix)
        if not self_attn:
            block["inverted_attention"] = inverted.pop(0)
        config = self_config if self_attn else cross_config
        return Attention.from_config(config.replace(**{k: v for k, v in block.items()
                                                       if self_attn or k not in overrides}))

    return attention_block


def _family(build: Callable, options: dict, *args):
    """``build(*args, **its keywords)``: an option family reads the options its signature names, by keyword, and
    nothing else (a name it misspells is a missing argument, never swallowed)."""
    params = inspect.signature(build).parameters
    return build(*args, **{n: options[n] for n, p in params.items() if p.kind == p.KEYWORD_ONLY})


def _options(config: dict) -> dict:
    """The stack's keywords as its families read them, each by its own name, the attention fields (checked once) as
    ``attn_<field>`` and together as ``attention_fields``. ``config`` then holds the fields in x-transformers'
    spelling, ``attn_<field>`` (typed on load by ``config_fields``), those given only: however they were spelt, one
    model has one config."""
    attention = _attention_options(config["attn_kwargs"])
    config["attn_kwargs"] = None
    config.update({f"attn_{k}": v for k, v in attention.items() if v is not ATTENTION_FIELDS[k].default})
    return {**config, **{f"attn_{k}": v for k, v in attention.items()}, "attention_fields": attention}


def _attention_options(attn_kwargs: dict | None) -> dict:
    """Every attention field (``ATTENTION_FIELDS``) with its value: ``attn_kwargs``' (x-transformers' ``attn_<field>``
    keywords land there) over ``Attention``'s default."""
    given = _family_kwargs("attn_kwargs", attn_kwargs, tuple(ATTENTION_FIELDS))
    return {k: given.get(k, p.default) for k, p in ATTENTION_FIELDS.items()}


def _family_kwargs(name: str, given: dict | None, allowed: tuple[str, ...]) -> dict:
    """``attn_kwargs`` / ``ff_kwargs`` checked: a dict of the keywords the stack hands to each of its modules."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise TypeError(f"{name} must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        import difflib

        close = [c for k in unknown for c in difflib.get_close_matches(k, allowed, n=2, cutoff=0.6)]
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f" (it takes {', '.join(allowed)})"
        raise TypeError(f"{name} got an unexpected keyword {', '.join(map(repr, unknown))}{hint}")
    return dict(given)


def _norms(stack: AttentionLayers, *, dim, use_rmsnorm, norm_eps, use_adaptive_layernorm, use_adaptive_rmsnorm,
           use_dynamic_tanh, dynamic_tanh_init_alpha, use_derf, adaptive_condition_mlp, adaptive_condition_mlp_expansion,
           use_scalenorm, use_simple_rmsnorm, norm_add_unit_offset) -> tuple[Callable[[], nn.Module], int | None]:
    """The norm options checked, the condition's MLP set on ``stack`` (``adaptive_mlp``), and ``(norm, cond_width)``:
    the factory of the stack's norms and the condition width the adaptive layers read (``None`` without them)."""
    adaptive_norm = use_adaptive_layernorm or use_adaptive_rmsnorm

    kinds = {"use_scalenorm": use_scalenorm, "use_simple_rmsnorm": use_simple_rmsnorm, "use_rmsnorm": use_rmsnorm,
             "use_dynamic_tanh": use_dynamic_tanh, "use_derf": use_derf, "use_adaptive_layernorm": use_adaptive_layernorm,
             "use_adaptive_rmsnorm": use_adaptive_rmsnorm}
    if sum(map(bool, (use_scalenorm, use_simple_rmsnorm))) and sum(map(bool, kinds.values())) > 1:
        raise ValueError(f"choose one norm: {', '.join(k for k, v in kinds.items() if v)} were given")
    if use_dynamic_tanh and (adaptive_norm or use_rmsnorm):
        raise ValueError("use_dynamic_tanh replaces the norms: choose it or use_rmsnorm / adaptive norms, not both")
    if use_derf and (adaptive_norm or use_rmsnorm or use_dynamic_tanh):
        raise ValueError("use_derf replaces the norms: choose it or use_rmsnorm / use_dynamic_tanh / adaptive norms")
    if adaptive_condition_mlp and not stack.adaptive:
        raise ValueError("adaptive_condition_mlp transforms the condition of adaptive layers: it needs "
                         "use_adaptive_layernorm / use_adaptive_rmsnorm / use_adaptive_layerscale")
    if isinstance(adaptive_condition_mlp_expansion, bool) or not isinstance(adaptive_condition_mlp_expansion, int) \
            or adaptive_condition_mlp_expansion < 1:
        raise ValueError(f"adaptive_condition_mlp_expansion must be a positive integer, got "
                         f"{adaptive_condition_mlp_expansion!r}")
    cond_width = None if not stack.adaptive else stack.dim_condition * (
        adaptive_condition_mlp_expansion if adaptive_condition_mlp else 1)
    stack.adaptive_mlp = nn.Sequential(nn.Linear(stack.dim_condition, cond_width, bias=False), nn.SiLU()) \
        if adaptive_condition_mlp else None

    if not isinstance(norm_add_unit_offset, bool):
        raise TypeError(f"norm_add_unit_offset must be a bool, got {norm_add_unit_offset!r}")
    offset = norm_add_unit_offset  # x-transformers' default: gains stored minus 1 (weight decay pulls to identity)

    def norm() -> nn.Module:
        if use_scalenorm or use_simple_rmsnorm:  # x-transformers' parts (their parameter names): x / ||x|| * sqrt(dim)
            from ..nn.xt_modules import ScaleNorm, SimpleRMSNorm

            return ScaleNorm(dim, offset) if use_scalenorm else SimpleRMSNorm(dim)
        if use_dynamic_tanh:
            return DynamicTanh(dim, init_alpha=dynamic_tanh_init_alpha, unit_offset=offset)
        if use_derf:
            return Derf(dim, unit_offset=offset)
        if adaptive_norm:
            return AdaptiveNorm(dim, cond_width, rms=use_adaptive_rmsnorm, eps=norm_eps)
        return make_norm(dim, use_rmsnorm, norm_eps, unit_offset=offset)

    return norm, cond_width


def _blocks(stack: AttentionLayers, layout: _Layout, attention, norm, cond_width: int | None, *, dim, causal, macaron,
            pre_norm, sandwich_norm, scale_residual, depth_scale_residual, scale_residual_constant,
            softclamp_output_value, use_layerscale, use_adaptive_layerscale, layerscale_init_value,
            zero_init_branch_output, shift_tokens, ff_glu, ff_swish, ff_softclamp_value, ff_custom_activation,
            ff_glu_softclamp, ff_glu_gate_softclamp_value, ff_glu_up_softclamp_value, custom_layers, par_ratio,
            sandwich_coef, polar_pos_emb, ff_kwargs, norm_add_unit_offset,
            gated_multi_residual) -> list[tuple[int, ...]]:
    """The branch options checked and the blocks built in order (``Block``: [norm, attention or feed-forward, gate]),
    set on ``stack`` with their layout (``layers``, ``layer_types``, ``layer_kinds``, the execution order). Returns
    each block's token shifts (``shift_tokens``)."""
    types, len_block = layout.types, layout.len_block
    ff_kwargs = _family_kwargs("ff_kwargs", ff_kwargs, FF_KWARGS)
    if ff_kwargs.get("dim_out", None) not in (None, dim):
        raise ValueError(f"ff_dim_out must be the stack's width {dim} (the branch adds to the residual), "
                         f"got {ff_kwargs['dim_out']!r}")
    branch_scale = _branch_scale(scale_residual, depth_scale_residual, scale_residual_constant, softclamp_output_value)
    if use_layerscale and use_adaptive_layerscale:
        raise ValueError("choose one of use_layerscale and use_adaptive_layerscale, not both")
    if sandwich_norm and not pre_norm:
        raise ValueError("sandwich_norm normalises the branch output of a pre-norm stack: not with pre_norm=False")
    shifts = _token_shifts(shift_tokens, len(types), causal)

    def block(kind: str, module: nn.Module, ind: int) -> Block:
        out_proj = module.to_out if kind != "ff" else module.proj_out
        if zero_init_branch_output and isinstance(out_proj, nn.Linear):  # x-transformers' zero_init_output
            nn.init.zeros_(out_proj.weight)
            if out_proj.bias is not None:
                nn.init.zeros_(out_proj.bias)
        elif depth_scale_residual is True and isinstance(out_proj, nn.Linear):  # OLMo's depth-scaled init
            nn.init.normal_(out_proj.weight, std=(2 * out_proj.in_features * (ind // len_block + 1)) ** -0.5)
        branch = module  # wrapped as x-transformers wraps it (its module tree and state-dict keys)
        if macaron and kind == "ff":
            branch = Scale(0.5, branch)
        if shifts[ind]:
            branch = ShiftTokens(shifts[ind], branch)
        if use_adaptive_layerscale:
            branch = AdaptiveLayerScale(branch, dim, cond_width)
        elif use_layerscale:
            branch = LayerScale(branch, dim, layerscale_init_value, unit_offset=norm_add_unit_offset)
        if branch_scale != 1.0:
            branch = Scale(branch_scale, branch)
        # gated_multi_residual's read gate normalises: no pre-norm (x-transformers)
        norms = (norm() if pre_norm and not gated_multi_residual else None, norm() if sandwich_norm else None, None)
        return Block(kind, norms, branch, Residual(dim))

    blocks = []
    for ind, kind in enumerate(types):
        layer = ind // len_block
        if kind == "a":
            blocks.append(block("self", attention(None, layer), ind))
        elif kind == "c":
            blocks.append(block("cross", attention(stack.dim_context, layer), ind))
        else:
            try:
                ff = FeedForward(dim, mult=_layer_value(layout.ff_mults, layer), glu=ff_glu, swish=ff_swish,
                                 dropout=_layer_value(layout.ff_dropouts, layer), softclamp_value=ff_softclamp_value,
                                 custom_activation=ff_custom_activation, glu_softclamp=ff_glu_softclamp,
                                 glu_gate_softclamp_value=ff_glu_gate_softclamp_value,
                                 glu_up_softclamp_value=ff_glu_up_softclamp_value, **ff_kwargs)
            except OptionTypeError as e:  # named as the stack spells it
                raise e.spelt("ff_") from None
            blocks.append(block("ff", ff, ind))
    stack.layers = nn.ModuleList(blocks)
    # x-transformers' per-layer slots (filled by the residual routing's options)
    stack.layer_integrators = nn.ModuleList([None] * len(blocks))
    stack.skip_combines = nn.ModuleList([None] * len(blocks))
    stack.layer_types = types  # x-transformers' 'a' / 'c' / 'f'
    stack.has_custom_layer_types = any(v is not None for v in (custom_layers, par_ratio, sandwich_coef))
    stack.layers_execute_order = tuple(range(len(types))) if layout.order is None else layout.order
    stack.default_order = layout.order  # None: every block once, in order
    stack.layer_kinds = tuple(blk.kind for blk in blocks)
    for blk in blocks:  # PoPE keys carry 2 d features (what a cache's self-attention keys are checked against)
        if blk.kind == "self" and polar_pos_emb:
            blk.mixer.polar_keys = True
    stack.len_default_block = len_block
    return shifts


def _routing_and_paths(stack: AttentionLayers, layout: _Layout, norm, shifts: list, *, dim, num_residual_streams,
                       qkv_receive_diff_residuals, integrate_layers, layer_integrate_use_softmax,
                       hyper_conn_sinkhorn_iters, unet_skips, reinject_input, learned_reinject_input_gate,
                       pre_and_post_norm, orthog_residual, mv_split_residual, residual_fn_kwargs,
                       use_adaptive_layernorm, use_adaptive_rmsnorm, pre_norm, scale_residual, scale_residual_constant,
                       gate_residual, softclamp_output, softclamp_output_value, unpadded, residual_attn,
                       cross_residual_attn, checkpoint_layers, pre_norm_has_final_norm, rotary_xpos, polar_pos_emb,
                       attn_aggregated_residuals, attn_aggregated_residual_kwargs, gated_multi_residual) -> None:
    """The residual routing (``routing``, x-transformers' residual options; ``None``: the plain residual), the
    final norm, residual attention, and which paths the options run on (``packable``: the unpadded path;
    ``static_step_reason``: off the static decode step; ``cache_refusal``: no KV cache), set on ``stack`` after
    checking them against ``unpadded`` and ``checkpoint_layers``."""
    stack.stream_emb = stack.reinject_input_proj = stack.learned_reinject_input_gate = None  # x-transformers' slots
    stack.routing = _residual_routing(stack, dim, layout.depth, norm, num_residual_streams=num_residual_streams,
                                      qkv_receive_diff_residuals=qkv_receive_diff_residuals,
                                      integrate_layers=integrate_layers,
                                      layer_integrate_use_softmax=layer_integrate_use_softmax,
                                      hyper_conn_sinkhorn_iters=hyper_conn_sinkhorn_iters, unet_skips=unet_skips,
                                      reinject_input=reinject_input,
                                      learned_reinject_input_gate=learned_reinject_input_gate,
                                      pre_and_post_norm=pre_and_post_norm, orthog_residual=orthog_residual,
                                      mv_split_residual=mv_split_residual, residual_fn_kwargs=residual_fn_kwargs,
                                      adaptive_norm=use_adaptive_layernorm or use_adaptive_rmsnorm,
                                      post_norm=not pre_norm,
                                      scale_residual=scale_residual is not False and bool(scale_residual),
                                      scale_residual_constant=scale_residual_constant, gate_residual=gate_residual,
                                      softclamp_output_value=softclamp_output_value if softclamp_output else None,
                                      attn_aggregated_residuals=attn_aggregated_residuals,
                                      attn_aggregated_residual_kwargs=attn_aggregated_residual_kwargs,
                                      gated_multi_residual=gated_multi_residual)
    if stack.routing is not None and unpadded is True:
        raise ValueError("unpadded=True cannot run the residual routing options (num_residual_streams, "
                         "integrate_layers, attn_aggregated_residuals, gated_multi_residual, unet_skips, "
                         "reinject_input, pre_and_post_norm, orthog_residual, "
                         "mv_split_residual, pre_norm=False, scale_residual, scale_residual_constant, gate_residual, "
                         "softclamp_output): they run on the padded path; use unpadded='auto' or False")
    stack.static_step_reason = None if stack.routing is None or not stack.routing.sequence_wide else \
        "orthog_residual / mv_split_residual update over the whole sequence (no KV cache)"
    # what runs without a KV cache, on the padded path, off the static step (besides the routing)
    stack.cache_refusal = None if not any(shifts) else (
        "shift_tokens reads earlier positions' normed inputs, which a KV cache does not keep: it runs without a "
        "KV cache; decode with cache_kv=False")
    padded_reason = stack.cache_refusal or (None if layout.order is None else (
        "weight_tie_layers / layers_execute_order run blocks again (the stack's forward, one cache entry per "
        "attention block run)"))
    if padded_reason is not None and unpadded is True:
        raise ValueError("unpadded=True cannot run weight_tie_layers, layers_execute_order or shift_tokens (they "
                         "run on the padded path); use unpadded='auto' or False")
    stack.static_step_reason = stack.static_step_reason or stack.cache_refusal
    stack.residual_attn, stack.cross_residual_attn = bool(residual_attn), bool(cross_residual_attn)
    if cross_residual_attn and not stack.has_cross:
        raise ValueError("cross_residual_attn carries cross-attention logits: it needs cross_attend=True")
    if (residual_attn or cross_residual_attn) and (checkpoint_layers or unpadded is True):
        raise ValueError("residual_attn / cross_residual_attn carry each attention's logits to the next: not with "
                         "checkpoint_layers or unpadded=True (they run on the padded path)")
    # x-transformers keeps the final norm with gated_multi_residual, whatever the norm options
    stack.final_norm = norm() if (pre_norm_has_final_norm and not pre_and_post_norm and pre_norm) or gated_multi_residual \
        else nn.Identity()
    # what a forward would otherwise ask every block each call, decided once
    stack.self_positions = any(getattr(blk.mixer, "needs_positions", False) for blk in stack.layers if blk.kind == "self")
    stack.inverted_cross = any(getattr(blk.mixer, "inverted", False) for blk in stack.layers if blk.kind == "cross")
    # the unpadded path packs tokens; Attention.packable says which options run on the padded path only
    stack.packable = all(blk.mixer.packable for blk in stack.layers if blk.kind != "ff") \
        and not stack.add_value_residual and stack.routing is None and not rotary_xpos and not polar_pos_emb \
        and padded_reason is None and not (residual_attn or cross_residual_attn)
    if unpadded is True and not stack.packable:
        raise ValueError("unpadded=True cannot run attn_num_mem_kv, attn_head_learned_sink, attn_softclamp_logits "
                         "attn_orthog_projected_values, attn_data_dependent_alibi, add_value_residual, rotary_xpos, "
                         "attn_hybrid_module, the scoring options (attn_l2_distance, attn_cog_signed, attn_sigmoid, "
                         "attn_gumbel_softmax, attn_laser, attn_use_cope, cross_attn_inverted_attention), "
                         "attn_use_rel_proj_pos_bias or attn_latent_rope_subheads (they run on the padded path); "
                         "use unpadded='auto' or False")


_LEGACY_ROUTING = (  # earlier safeformer's ResidualRouting held them: (old, new), {i} a layer index
    (re.compile(r"routing\.post_norms\.(\d+)\."), r"layers.\1.0.2."),
    (re.compile(r"routing\.residual_scales\.(\d+)$"), r"layers.\1.2.residual_scale"),
    (re.compile(r"routing\.grus\.(\d+)\."), r"layers.\1.2.gru."),
    (re.compile(r"routing\.(?:hyper|mv_split)\.(\d+)\."), r"layers.\1.2."),
    (re.compile(r"routing\.integrators\.(\d+)\."), r"layer_integrators.\1."),
    (re.compile(r"routing\.skip_combines\.(\d+)\."), r"skip_combines.\1."),
    (re.compile(r"routing\.(stream_emb$|reinject_input_proj\.|learned_reinject_input_gate\.)"), r"\1"),
)


def _legacy_routing_keys(state_dict, prefix, *_args) -> None:
    """A checkpoint of earlier safeformer: the residual routing's parameters moved to where x-transformers keeps them
    (each layer's norms and residual, the stack's integrators, skips, reinjection and stream embedding)."""
    for key in [k for k in state_dict if k.startswith(prefix + "routing.")]:
        rest = key[len(prefix):]
        for pattern, new in _LEGACY_ROUTING:
            moved, n = pattern.subn(new, rest, count=1)
            if n and pattern.match(rest):
                state_dict[prefix + moved] = state_dict.pop(key)
                break


def _cross_attn_spellings(aliases: dict) -> tuple[dict, dict]:
    """Split x-transformers' ``cross_attn_<keyword>`` spellings (``<keyword>`` an ``Attention`` keyword-only
    parameter: x-transformers hands them to the cross-attention's ``Attention``) from the other aliases."""
    import inspect

    params = inspect.signature(Attention.__init__).parameters
    names = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    rest, per_kind = {}, {}
    for key, value in aliases.items():
        name = key[len("cross_attn_"):] if key.startswith("cross_attn_") else None
        if name in names and key not in LAYER_ALIASES:
            per_kind[name] = value
        else:
            rest[key] = value
    return rest, per_kind


def _inverted_per_layer(value, n_cross: int, causal: bool) -> list[bool]:
    """``cross_attn_inverted_attention`` as one bool per cross-attention block (a bool for all, or a tuple of one
    per block, as x-transformers takes it); refused in a causal stack (a query's weights would be normalised over
    later queries too: the future would leak)."""
    if isinstance(value, bool):
        per = [value] * n_cross
    elif isinstance(value, (tuple, list)) and all(isinstance(v, bool) for v in value) and len(value) == n_cross:
        per = list(value)
    else:
        raise ValueError(f"cross_attn_inverted_attention must be a bool or a tuple of {n_cross} bools (one per "
                         f"cross-attention block), got {value!r}")
    if causal and any(per):
        raise ValueError("cross_attn_inverted_attention normalises over the queries: in a causal stack a position "
                         "would see later positions through it (x-transformers warns); use it without causal")
    return per



def layer_schedule(start: float, end: float, depth: int, schedule="cosine") -> tuple[float, ...]:
    """x-transformers' per-layer schedule: ``depth`` values from ``start`` (first layer) to ``end`` (last), for
    ``ff_mult``, ``attn_dropout`` or ``ff_dropout`` (e.g. ``Decoder(ff_mult=layer_schedule(6, 2, 12))``).

    Args:
        start, end: the first and the last layer's value.
        depth: the number of layers (at least 2).
        schedule: ``"cosine"`` (``start + (end - start) * (1 - cos(pi t)) / 2``), ``"linear"``, or a callable
            ``f(start, end, t)`` with ``t = layer / (depth - 1)`` in ``[0, 1]``.

    Returns:
        A tuple of ``depth`` values.
    """
    import math

    if not (callable(schedule) or schedule in ("linear", "cosine")):
        raise ValueError(f"schedule must be 'linear', 'cosine' or a callable f(start, end, t), got {schedule!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
        raise ValueError(f"depth must be an integer of at least 2 (a schedule tapers over the layers), got {depth!r}")
    if schedule == "linear":
        schedule = lambda a, b, t: a + (b - a) * t  # noqa: E731
    elif schedule == "cosine":
        schedule = lambda a, b, t: a + (b - a) * 0.5 * (1 - math.cos(math.pi * t))  # noqa: E731
    return tuple(schedule(start, end, layer / (depth - 1)) for layer in range(depth))


def _per_layer(name: str, value, depth: int):
    """``value`` (a number) or a sequence of ``depth`` numbers, one per layer (x-transformers' schedules)."""
    if isinstance(value, (tuple, list)):
        if len(value) != depth or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{name} must be a number or a sequence of depth={depth} numbers (one per layer), "
                             f"got {value!r}")
        return tuple(value)
    return value


def _layer_value(value, layer: int, scheduled: bool = True):
    """Layer ``layer``'s value of a ``_per_layer`` option (``scheduled`` False: the default of a block a
    sequence does not set, x-transformers' cross-attention under a per-layer ``attn_dropout``)."""
    if isinstance(value, tuple):
        return value[layer] if scheduled else 0.0
    return value


def _layer_types(*, depth, cross: bool, only_cross: bool, macaron: bool, only_attn: bool, custom_layers, par_ratio,
                 sandwich_coef, weight_tie_layers: bool, layers_execute_order, unet_skips: bool, per_layer: list):
    """x-transformers' layer pattern: ``(block kinds ('a' / 'c' / 'f'), blocks per layer, the constructor's execution
    order or None, depth)`` (``depth``: the layers, x-transformers' ``self.depth``: 1 with ``weight_tie_layers``)."""
    chosen = [name for name, v in (("custom_layers", custom_layers), ("par_ratio", par_ratio),
                                   ("sandwich_coef", sandwich_coef)) if v is not None]
    if len(chosen) > 1:
        raise ValueError(f"choose one layer layout of custom_layers, par_ratio and sandwich_coef, got {chosen}")
    if weight_tie_layers and (chosen or layers_execute_order is not None):
        raise ValueError("weight_tie_layers repeats the default layer: not with custom_layers, par_ratio, "
                         "sandwich_coef or layers_execute_order")
    if unet_skips and (weight_tie_layers or layers_execute_order is not None):
        raise ValueError("unet_skips pairs the layers of the stack: not with weight_tie_layers or layers_execute_order "
                         "(a tied stack has one layer, no skip to pair)")
    if only_attn and (layers_execute_order is not None or unet_skips):
        raise ValueError("only_attn is not compatible with layers_execute_order or unet_skips (as in x-transformers)")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0):
        raise ValueError(f"depth must be a positive integer, got {depth!r}")
    if depth is None and custom_layers is None:
        raise ValueError("depth must be given (it may be left out with custom_layers only)")
    if per_layer and (chosen or weight_tie_layers):
        raise ValueError("a per-layer sequence (ff_mult, attn_dropout, ff_dropout) needs the default layers: not "
                         "with custom_layers, par_ratio, sandwich_coef or weight_tie_layers")
    default = (("c",) if only_cross else ("a", "c") if cross else ("a",)) + ("f",)
    if macaron:
        default = ("f",) + default
    if only_attn:
        default = tuple(t for t in default if t != "f")
    len_block, order = 1, None
    if custom_layers is not None:
        types = tuple(custom_layers) if isinstance(custom_layers, (tuple, list)) else None
        if not types or any(t not in ("a", "c", "f") for t in types):
            raise ValueError(f"custom_layers must be a non-empty tuple of 'a', 'c' and 'f', got {custom_layers!r}")
        if "c" in types and not cross:
            raise ValueError("custom_layers has cross-attention blocks ('c'): set cross_attend=True")
        if "a" in types and only_cross:
            raise ValueError("custom_layers has self-attention blocks ('a'): not with only_cross")
        if only_attn and "f" in types:
            raise ValueError("only_attn is not compatible with feed-forward blocks ('f') in custom_layers")
    elif par_ratio is not None:
        par_depth = depth * len(default)
        if isinstance(par_ratio, bool) or not isinstance(par_ratio, int) or not 1 < par_ratio <= par_depth:
            raise ValueError(f"par_ratio must be an integer in (1, {par_depth}] (depth * blocks per layer), "
                             f"got {par_ratio!r}")
        attn_block = tuple(t for t in default if t != "f")
        par_attn = par_depth // par_ratio
        depth_cut = par_depth * 2 // 3  # the PAR paper's 2/3 attention cutoff
        par_width = (depth_cut + depth_cut // par_attn) // par_attn
        if len(attn_block) > par_width:
            raise ValueError(f"par_ratio={par_ratio} leaves {par_width} blocks per group, fewer than the attention "
                             f"blocks of a layer ({len(attn_block)}): use a smaller par_ratio or a deeper stack")
        head = (attn_block + ("f",) * (par_width - len(attn_block))) * par_attn
        types = head + ("f",) * (par_depth - len(head))
    elif sandwich_coef is not None:
        if isinstance(sandwich_coef, bool) or not isinstance(sandwich_coef, int) or not 0 < sandwich_coef <= depth:
            raise ValueError(f"sandwich_coef must be an integer in (0, depth={depth}], got {sandwich_coef!r}")
        types = ("a",) * sandwich_coef + default * (depth - sandwich_coef) + ("f",) * sandwich_coef
    else:
        types = default * (1 if weight_tie_layers else depth)
        len_block = len(default)
        if weight_tie_layers:
            order = tuple(range(len(default))) * depth
    if only_attn:
        types = tuple(t for t in types if t != "f")
        if not types:
            raise ValueError("only_attn leaves no block: the layout has attention blocks to keep")
    if layers_execute_order is not None:
        if not isinstance(layers_execute_order, (tuple, list)) or not layers_execute_order or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(types) for i in layers_execute_order):
            raise ValueError(f"layers_execute_order must be a non-empty sequence of block indices in [0, {len(types)}), "
                             f"got {layers_execute_order!r}")
        order = tuple(layers_execute_order)
    if order == tuple(range(len(types))):
        order = None
    if weight_tie_layers:
        depth = 1
    elif depth is None:
        depth = len(types) if order is None else len(order)
    return types, len_block, order, depth


def _branch_scale(scale_residual, depth_scale_residual, scale_residual_constant, softclamp_output_value) -> float:
    """x-transformers' float residual scale of every branch output (``depth_scale_residual`` first, then
    ``scale_residual``, a bool being no scale), after checking the residual scaling options."""
    import math

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for name, v in (("scale_residual", scale_residual), ("depth_scale_residual", depth_scale_residual)):
        if not (isinstance(v, bool) or (number(v) and math.isfinite(v))):
            raise ValueError(f"{name} must be a bool or a finite number, got {v!r}")
    if not (number(scale_residual_constant) and math.isfinite(scale_residual_constant)):
        raise ValueError(f"scale_residual_constant must be a finite number, got {scale_residual_constant!r}")
    if not (number(softclamp_output_value) and math.isfinite(softclamp_output_value) and softclamp_output_value > 0):
        raise ValueError(f"softclamp_output_value must be a positive finite number, got {softclamp_output_value!r}")
    if number(depth_scale_residual):
        return float(depth_scale_residual)
    return float(scale_residual) if number(scale_residual) else 1.0


def _token_shifts(shift_tokens, num_blocks: int, causal: bool) -> list[tuple[int, ...]]:
    """x-transformers' ``shift_tokens`` (an int, or one per block) as each block's shifts: ``0..k`` (``-k..k``
    without ``causal``), ``()`` for ``k == 0``."""
    per = shift_tokens if isinstance(shift_tokens, (tuple, list)) else (shift_tokens,) * num_blocks
    if len(per) != num_blocks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in per):
        raise ValueError(f"shift_tokens must be a non-negative integer or a tuple of {num_blocks} (one per block), "
                         f"got {shift_tokens!r}")
    return [tuple(range(0 if causal else -k, k + 1)) if k > 0 else () for k in per]


def _residual_routing(stack, dim: int, depth: int, norm, *, num_residual_streams, qkv_receive_diff_residuals,
                      integrate_layers, reinject_input, pre_and_post_norm, orthog_residual, mv_split_residual,
                      residual_fn_kwargs, adaptive_norm, unet_skips, learned_reinject_input_gate, post_norm=False,
                      scale_residual=False, scale_residual_constant=1.0, gate_residual=False,
                      softclamp_output_value=None, attn_aggregated_residuals=False, gated_multi_residual=False,
                      **kwargs):
    """The stack's ``ResidualRouting`` for x-transformers' residual options (``None`` when none is on: the
    plain residual), after checking that they agree."""
    s = num_residual_streams
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ValueError(f"num_residual_streams must be a positive integer, got {s!r}")
    if qkv_receive_diff_residuals and s == 1 and not (integrate_layers or attn_aggregated_residuals
                                                       or gated_multi_residual):
        raise ValueError("qkv_receive_diff_residuals mixes the residual streams three ways: it needs "
                         "num_residual_streams > 1 (hyper-connections), integrate_layers, attn_aggregated_residuals "
                         "or gated_multi_residual")
    streams = s > 1 or gated_multi_residual  # the stream is S streams (S may be 1 with gated_multi_residual)
    post_norm = post_norm or gated_multi_residual  # x-transformers norms the streams after every gated block
    if sum(map(bool, (orthog_residual, mv_split_residual, s > 1))) > 1:
        raise ValueError("choose one of num_residual_streams > 1, orthog_residual and mv_split_residual")
    if reinject_input and s > 1:
        raise ValueError("reinject_input adds the input to a single stream: not with num_residual_streams > 1")
    if learned_reinject_input_gate and not reinject_input:
        raise ValueError("learned_reinject_input_gate gates reinject_input: set reinject_input=True")
    if pre_and_post_norm and adaptive_norm and s > 1:
        raise ValueError("pre_and_post_norm with adaptive norms normalises one stream: not with num_residual_streams > 1")
    if residual_fn_kwargs:
        allowed = {"learned", "init_alpha", "init_beta"} if mv_split_residual else \
            {"read_gate_rank"} if gated_multi_residual else set()
        bad = set(residual_fn_kwargs) - allowed
        if bad:
            raise ValueError(f"residual_fn_kwargs {sorted(bad)} are not read: residual_fn_kwargs takes learned, "
                             "init_alpha and init_beta for mv_split_residual, read_gate_rank for gated_multi_residual")
    if sum(map(bool, (orthog_residual, mv_split_residual, s > 1, gate_residual))) > 1:
        raise ValueError("choose one of num_residual_streams > 1, orthog_residual, mv_split_residual and gate_residual")
    if (scale_residual or scale_residual_constant != 1.0) and (orthog_residual or mv_split_residual or streams):
        raise ValueError("scale_residual / scale_residual_constant scale the plain residual: not with orthog_residual, "
                         "mv_split_residual, gated_multi_residual or num_residual_streams > 1 (x-transformers "
                         "ignores them there)")
    if gate_residual and scale_residual_constant != 1.0:
        raise ValueError("gate_residual does not read scale_residual_constant (as in x-transformers): leave it at 1")
    if post_norm and adaptive_norm and s > 1:
        raise ValueError("pre_norm=False (or gated_multi_residual, which norms the streams after every block) with "
                         "adaptive norms normalises one stream: not with num_residual_streams > 1")
    if not (streams or integrate_layers or attn_aggregated_residuals or unet_skips or reinject_input or pre_and_post_norm or orthog_residual
            or mv_split_residual or post_norm or scale_residual or scale_residual_constant != 1.0 or gate_residual
            or softclamp_output_value is not None):
        return None
    return ResidualRouting(
        stack, dim, len_block=stack.len_default_block, depth=depth, norm=norm, num_residual_streams=s,
        qkv_receive_diff_residuals=qkv_receive_diff_residuals, integrate_layers=integrate_layers, unet_skips=unet_skips,
        reinject_input=reinject_input, learned_reinject_input_gate=learned_reinject_input_gate,
        pre_and_post_norm=pre_and_post_norm, orthog_residual=orthog_residual, mv_split_residual=mv_split_residual,
        residual_fn_kwargs=residual_fn_kwargs, post_norm=post_norm, scale_residual=scale_residual,
        scale_residual_constant=scale_residual_constant, gate_residual=gate_residual,
        softclamp_output_value=softclamp_output_value, attn_aggregated_residuals=attn_aggregated_residuals,
        gated_multi_residual=gated_multi_residual, **kwargs)


_AGGREGATED_KWARGS = ("lora_rank", "lora_activation")  # AttentionResidual's keywords besides dim and num_views


def _check_residual_kinds(*, attn_aggregated_residuals, attn_aggregated_residual_kwargs, gated_multi_residual,
                          integrate_layers, gate_residual, orthog_residual, mv_split_residual,
                          qkv_receive_diff_residuals, num_residual_streams, scale_residual, depth_scale_residual,
                          sandwich_norm, use_dynamic_tanh, pre_norm_has_final_norm) -> None:
    """``attn_aggregated_residuals`` and ``gated_multi_residual`` against the other residual options: what
    x-transformers asserts against, and what it would silently ignore or fail on, raises ``ValueError``."""
    for name, v in (("attn_aggregated_residuals", attn_aggregated_residuals),
                    ("gated_multi_residual", gated_multi_residual)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    kwargs = attn_aggregated_residual_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"attn_aggregated_residual_kwargs must be a dict, got {type(kwargs).__name__}")
    if kwargs and not attn_aggregated_residuals:
        raise ValueError("attn_aggregated_residual_kwargs configures attn_aggregated_residuals: set it to True")
    bad = sorted(set(kwargs or {}) - set(_AGGREGATED_KWARGS))
    if bad:
        raise TypeError(f"attn_aggregated_residual_kwargs got unexpected keys {bad}: it takes "
                        f"{', '.join(_AGGREGATED_KWARGS)}")
    chosen = [k for k, v in (("gate_residual", gate_residual), ("attn_aggregated_residuals", attn_aggregated_residuals),
                             ("orthog_residual", orthog_residual), ("mv_split_residual", mv_split_residual),
                             ("gated_multi_residual", gated_multi_residual)) if v]
    if len(chosen) > 1:
        raise ValueError(f"{', '.join(chosen)} are mutually exclusive (x-transformers: choose one of gate_residual, "
                         "attn_aggregated_residuals, orthog_residual, mv_split_residual and gated_multi_residual)")
    if attn_aggregated_residuals and integrate_layers:
        raise ValueError("attn_aggregated_residuals and integrate_layers both mix the earlier blocks' inputs: choose "
                         "one (x-transformers builds LIMe and ignores attn_aggregated_residuals)")
    if attn_aggregated_residuals and qkv_receive_diff_residuals and num_residual_streams > 1:
        raise ValueError("attn_aggregated_residuals with qkv_receive_diff_residuals and num_residual_streams > 1 "
                         "would attend over hiddens of different shapes (x-transformers fails there): drop one")
    if attn_aggregated_residuals and not (scale_residual is False or scale_residual is True) \
            or attn_aggregated_residuals and depth_scale_residual is not False:
        raise ValueError("attn_aggregated_residuals leaves the branch outputs unscaled (x-transformers ignores a float "
                         "scale_residual and depth_scale_residual there): not with them")
    if gated_multi_residual and sandwich_norm:
        raise ValueError("sandwich_norm normalises a pre-norm stack's branch output: not with gated_multi_residual "
                         "(it has no pre-norm)")
    if gated_multi_residual and use_dynamic_tanh:
        raise ValueError("use_dynamic_tanh is for pre-norm stacks (x-transformers): not with gated_multi_residual")
    if gated_multi_residual and not pre_norm_has_final_norm:
        raise ValueError("gated_multi_residual always ends with the final norm (x-transformers ignores "
                         "pre_norm_has_final_norm=False there): leave it True")


def _check_options(*, dim, depth, dim_head, causal, cross_attend, only_cross, rotary_pos_emb, rotary_emb_dim,
                   alibi_pos_bias, use_adaptive_layernorm, use_adaptive_rmsnorm, use_adaptive_layerscale,
                   dim_condition, adaptive_null, layer_dropout, cross_attn_tokens_dropout, checkpoint_layers,
                   unpadded, rotate_num_heads, rotary_xpos) -> None:
    """``AttentionLayers``' options that must agree with each other (the modules check their own)."""
    if rotate_num_heads is not None and not (rotary_pos_emb or rotary_xpos):
        raise ValueError("rotate_num_heads chooses the heads rotary positions rotate: it needs rotary_pos_emb=True")
    if unpadded not in (True, False, "auto"):
        raise ValueError(f"unpadded must be True, False or 'auto', got {unpadded!r}")
    if not isinstance(checkpoint_layers, bool):
        raise TypeError(f"checkpoint_layers must be a bool, got {checkpoint_layers!r}")
    if use_adaptive_layernorm and use_adaptive_rmsnorm:
        raise ValueError("choose one of use_adaptive_layernorm and use_adaptive_rmsnorm, not both")
    adaptive = use_adaptive_layernorm or use_adaptive_rmsnorm or use_adaptive_layerscale
    # dim_condition without an adaptive option is unused, as in x-transformers (a condition passed to forward
    # is then refused: nothing would read it)
    if adaptive_null not in ("learned", "zeros"):
        raise ValueError(f"adaptive_null must be 'learned' or 'zeros', got {adaptive_null!r}")
    for name, p in (("layer_dropout", layer_dropout), ("cross_attn_tokens_dropout", cross_attn_tokens_dropout)):
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0):
            raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    if cross_attn_tokens_dropout > 0 and not (cross_attend or only_cross):
        raise ValueError("cross_attn_tokens_dropout needs cross-attention (cross_attend=True)")
    k = (dim if dim_condition is None else dim_condition) if adaptive else None
    if adaptive and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"dim_condition must be a positive integer, got {k!r}")
    if dim <= 0 or (depth is not None and depth <= 0):
        raise ValueError(f"dim and depth must be positive, got dim={dim}, depth={depth}")
    if rotary_pos_emb and alibi_pos_bias:
        raise ValueError("choose one relative position scheme: rotary_pos_emb or alibi_pos_bias, not both")
    if only_cross and causal:
        raise ValueError("only_cross=True has no self-attention, so causal=True has no meaning")
    rot = dim_head // 2 if rotary_emb_dim is None else rotary_emb_dim
    if rotary_pos_emb and not (0 < rot <= dim_head):
        raise ValueError(f"rotary_emb_dim must be in (0, dim_head={dim_head}], got {rot}")



def _no_causal(kwargs: dict, name: str) -> None:
    if "causal" in kwargs:
        raise TypeError(f"{name} sets causal itself; use AttentionLayers(causal=...) to choose")


class Encoder(AttentionLayers):
    """Bidirectional ``AttentionLayers`` (every position sees every real position)."""

    def __init__(self, **kwargs):
        _no_causal(kwargs, "Encoder")
        super().__init__(causal=False, **kwargs)
        self._sf_config.pop("causal")


class Decoder(AttentionLayers):
    """Causal ``AttentionLayers``; with ``cross_attend=True`` it takes ``context`` and ``context_mask``."""

    def __init__(self, **kwargs):
        _no_causal(kwargs, "Decoder")
        super().__init__(causal=True, **kwargs)
        self._sf_config.pop("causal")


class CrossAttender(AttentionLayers):
    """Cross-attention and feed-forward blocks only (no self-attention); needs a ``context``."""

    def __init__(self, **kwargs):
        for key in ("causal", "cross_attend", "only_cross"):
            if key in kwargs:
                raise TypeError(f"CrossAttender sets {key} itself")
        super().__init__(cross_attend=True, only_cross=True, **kwargs)
        for key in ("causal", "cross_attend", "only_cross"):
            self._sf_config.pop(key)


class PrefixDecoder(AttentionLayers):
    """A prefix-LM stack (x-transformers' ``PrefixDecoder``): causal self-attention, except that the first
    ``prefix_attn_len`` positions of each sample see each other both ways.

    ``forward(x, prefix_attn_len=None, attn_mask=None, **kwargs)``: ``prefix_attn_len`` is an int or a
    ``(b,)`` integer tensor counting positions of ``x`` (padding included, as x-transformers counts);
    ``attn_mask`` is combined with the prefix mask. With a ``cache`` the new positions are causal over
    everything cached (the prefix was the first call's). Masks, padding and the cache are as
    ``AttentionLayers.forward``: a real query always sees itself, so no row of a real position is dead.
    """

    def __init__(self, **kwargs):
        _no_causal(kwargs, "PrefixDecoder")
        super().__init__(causal=False, **kwargs)
        self._sf_config.pop("causal")

    def forward(self, x: Tensor, *args, attn_mask: Tensor | None = None, prefix_attn_len=None, **kwargs):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"x must have shape (b, n, dim={self.dim}), got {getattr(x, 'shape', type(x))}")
        b, n, device = x.shape[0], x.shape[1], x.device
        cache = kwargs.get("cache")
        past = cache.length if isinstance(cache, KVCache) else 0
        allowed = causal_mask(n, past + n, device=device).reshape(n, past + n)  # bottom-right
        if prefix_attn_len is not None and past == 0:
            if isinstance(prefix_attn_len, bool) or not isinstance(prefix_attn_len, (int, Tensor)):
                raise TypeError(f"prefix_attn_len must be an int or a (b,) integer tensor, got {type(prefix_attn_len).__name__}")
            if isinstance(prefix_attn_len, int):
                prefix_attn_len = torch.full((b,), prefix_attn_len, device=device)
            if prefix_attn_len.shape != (b,) or prefix_attn_len.is_floating_point() or prefix_attn_len.dtype == torch.bool:
                raise ValueError(f"prefix_attn_len must be an int or a (b={b},) integer tensor, got "
                                 f"{prefix_attn_len.dtype} {tuple(prefix_attn_len.shape)}")
            if bool(((prefix_attn_len < 0) | (prefix_attn_len > n)).any()):
                raise ValueError(f"prefix_attn_len must be in [0, n={n}], got {prefix_attn_len.tolist()}")
            in_prefix = torch.arange(n, device=device) < prefix_attn_len.to(device)[:, None]  # (b, n) keys
            allowed = allowed[None] | in_prefix[:, None, :]  # (b, n, n): every query sees the prefix
        if attn_mask is not None:
            validate_mask(attn_mask, "attn_mask", device=device)
            allowed = allowed & attn_mask
        if allowed.dim() == 3 and allowed.shape[0] != b:
            allowed = allowed.expand(b, -1, -1)
        return super().forward(x, *args, attn_mask=allowed, **kwargs)


class TransformerBlock(AttentionLayers):
    """x-transformers' ``TransformerBlock(dim, depth=1, pre_norm_has_final_norm=False, **options)``: an
    ``AttentionLayers`` of one layer by default, without the final norm."""

    def __init__(self, *args, **kwargs):
        if len(args) > 1:
            raise TypeError("TransformerBlock takes dim as its only positional argument")
        if args:
            if "dim" in kwargs:
                raise TypeError("TransformerBlock got dim twice")
            kwargs["dim"] = args[0]
        kwargs.setdefault("depth", 1)
        kwargs.setdefault("pre_norm_has_final_norm", False)
        super().__init__(**kwargs)


def _ff_fields() -> tuple[str, ...]:
    """The feed-forward family's fields the stack hands on through ``ff_kwargs`` (``ff_<name>``): ``FeedForward``'s
    parameters except its width and those the stack names itself (``ff_mult``, ``ff_glu``, ...: read from
    ``AttentionLayers``' signature, never listed here)."""
    own = inspect.signature(AttentionLayers.__init__).parameters
    return tuple(n for n in inspect.signature(FeedForward.__init__).parameters
                 if n not in ("self", "dim") and f"ff_{n}" not in own)


FF_KWARGS = _ff_fields()
# x-transformers' ff_<name> spellings, before the default-only keywords (which win on a shared name)
LAYER_ALIASES.update({f"ff_{k}": _into("ff_kwargs", k) for k in FF_KWARGS if f"ff_{k}" not in XT_DEFAULT_ONLY})
