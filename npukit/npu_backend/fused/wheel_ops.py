"""Every op torch_npu 2.13's own op docs describe (`torch_npu/_op_plugin_docs.py` in the wheel, in
the order it documents them): the list docs/fused-ops.md states each op's emulation state for, and
the names `torch_npu` answers with a clear error when the emulator lacks the op.

`UNFUSED` says, for ops not emulated yet, what to run instead on the emulator (the error names it);
`NO_UNFUSED_EQUIVALENT` says, for the few that compute nothing a model needs (cache prefetch, memory
codecs, serving schedulers, a TEE service), what they are and what to do instead.
"""

WHEEL_DOCUMENTED_OPS = (
    "_npu_dropout", "copy_memory_", "empty_with_format", "fast_gelu", "npu_fast_gelu",
    "npu_alloc_float_status", "npu_anchor_response_flags", "npu_apply_adam", "npu_apply_adam_w_out",
    "npu_batch_gather_matmul", "npu_batch_gather_matmul_", "npu_batch_nms", "npu_bert_apply_adam",
    "batch_norm_reduce", "npu_block_sparse_attention", "npu_bmmV2", "npu_bounding_box_decode",
    "npu_bounding_box_encode", "npu_broadcast", "npu_ciou", "npu_clear_float_status",
    "npu_confusion_transpose", "npu_conv2d", "npu_conv3d", "npu_conv_transpose2d", "npu_convolution",
    "npu_convolution_transpose", "npu_deformable_conv2d", "npu_diou", "npu_dropout_with_add_softmax",
    "npu_dtype_cast", "npu_format_cast", "npu_format_cast_", "npu_fused_attention_score",
    "npu_lightning_indexer", "npu_quant_lightning_indexer", "npu_sparse_flash_attention",
    "npu_kv_quant_sparse_flash_attention", "npu_fusion_attention", "npu_fusion_attention_v3", "npu_geglu",
    "npu_get_float_status", "npu_giou", "npu_grid_assign_positive", "npu_gru", "npu_hans_encode",
    "npu_hans_decode", "npu_ifmr", "npu_indexing", "npu_iou", "npu_layer_norm_eval",
    "npu_attention_update", "npu_ring_attention_update", "npu_linear", "npu_lstm", "npu_masked_fill_range",
    "npu_max", "npu_min", "npu_mish", "npu_multi_head_attention", "npu_nms_rotated", "npu_nms_v4",
    "npu_nms_with_mask", "npu_normalize_batch", "npu_one_hot", "npu_pad", "npu_ps_roi_pooling",
    "npu_ptiou", "npu_random_choice_with_mask", "npu_reshape", "npu_rms_norm", "npu_roi_align",
    "npu_rotary_mul", "npu_mrope", "npu_rotated_box_decode", "npu_rotated_box_encode", "npu_rotated_iou",
    "npu_rotated_overlaps", "npu_scaled_masked_softmax", "npu_scatter", "npu_sign_bits_pack",
    "npu_sign_bits_unpack", "npu_silu", "npu_slice", "npu_softmax_cross_entropy_with_logits",
    "npu_sort_v2", "npu_stride_add", "npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_sinkhorn_backward",
    "npu_mhc_pre_backward", "npu_transpose", "npu_yolo_boxes_encode", "one_", "npu_swiglu",
    "npu_trans_quant_param", "npu_mhc_post", "npu_mhc_post_backward", "npu_dynamic_quant",
    "npu_dynamic_quant_asymmetric", "npu_quant_matmul_reduce_sum", "npu_quant_matmul",
    "npu_quant_matmul_gelu", "npu_matmul_compress_dequant", "npu_weight_quant_batchmatmul",
    "npu_transpose_batchmatmul", "npu_transpose_quant_batchmatmul", "npu_convert_weight_to_int4pack",
    "npu_grouped_matmul", "npu_rms_norm_quant", "npu_grouped_matmul_finalize_routing", "npu_quant_scatter",
    "npu_quant_scatter_", "npu_scatter_nd_update", "npu_recurrent_gated_delta_rule",
    "npu_recurrent_gated_delta_rule_functional", "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache",
    "npu_anti_quant", "npu_mm_all_reduce_base", "npu_ffn", "npu_incre_flash_attention",
    "npu_prompt_flash_attention", "npu_fused_infer_attention_score",
    "_npu_fused_infer_attention_score_get_max_workspace", "_npu_fused_infer_attention_score_infer_output",
    "npu_fused_infer_attention_score_v2", "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_infer_output", "npu_mla_prolog", "npu_mla_prolog_v2",
    "npu_mla_prolog_v3", "npu_mla_prolog_v3_functional", "npu_all_gather_base_mm", "npu_group_norm_silu",
    "npu_mm_reduce_scatter_base", "npu_moe_compute_expert_tokens", "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k_softmax_v2", "npu_moe_gating_top_k",
    "npu_moe_gating_top_k_backward", "npu_moe_init_routing", "npu_moe_init_routing_v2",
    "npu_moe_token_permute_with_routing_map", "npu_prefetch", "npu_quantize", "npu_kronecker_quant",
    "scatter_update", "scatter_update_", "npu_group_norm_swish", "npu_dequant_swiglu_quant",
    "npu_clipped_swiglu", "npu_fused_causal_conv1d", "npu_masked_causal_conv1d",
    "npu_masked_causal_conv1d_backward", "npu_cross_entropy_loss", "npu_chunk_gated_delta_rule",
    "npu_gemma_rms_norm", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_cast",
    "npu_add_rms_norm_quant", "npu_advance_step_flashattn", "empty_with_swapped_memory",
    "npu_alltoallv_gmm", "npu_alltoallv_quant_gmm", "npu_swiglu_quant", "npu_grouped_matmul_swiglu_quant",
    "npu_grouped_matmul_swiglu_quant_v2", "npu_gmm_alltoallv", "npu_quant_gmm_alltoallv",
    "npu_nsa_compress", "npu_nsa_compress_infer", "npu_nsa_compress_attention",
    "npu_nsa_compress_attention_infer", "npu_nsa_select_attention", "npu_nsa_select_attention_infer",
    "npu_gather_sparse_index", "npu_moe_update_expert", "npu_top_k_top_p", "ffn_worker_scheduler_",
    "ffn_worker_scheduler", "attention_worker_scheduler_", "attention_worker_scheduler",
    "npu_top_k_top_p_sample", "npu_moe_token_permute", "npu_moe_token_unpermute",
    "npu_dynamic_block_quant", "obfuscation_initialize", "obfuscation_finalize", "obfuscation_calculate",
    "npu_gelu_mul", "npu_sparse_lightning_indexer_grad_kl_loss", "npu_sim_exponential_",
    "npu_fused_floyd_attention", "npu_dense_lightning_indexer_softmax_lse",
    "npu_dense_lightning_indexer_grad_kl_loss", "_lstm_npu", "_lstm_npu_backward", "npu_rotate_quant",
    "npu_quant_max", "npu_apply_rotary_pos_emb", "npu_fused_linear_online_max_sum",
    "npu_fused_cross_entropy_loss_with_max_sum",
    "npu_fused_linear_cross_entropy_loss_with_max_sum_backward", "npu_all_gather_quant_mm",
    "npu_dynamic_mx_quant_with_dual_axis", "npu_fusion_attention_v2", "npu_grouped_dynamic_mx_quant",
    "npu_grouped_matmul_add", "npu_quant_mm_reduce_scatter", "npu_moe_token_unpermute_with_routing_map",
    "npu_add_quant_gmm_", "npu_apply_adam_w", "npu_dynamic_mx_quant",
)

UNFUSED = {
    "npu_fusion_attention_v3": "torch_npu.npu_fusion_attention (same semantics, int list sequence lengths)",
    "npu_ffn": "activation(x @ weight1 + bias1) @ weight2 + bias2",
    "npu_moe_gating_top_k": "torch.topk over torch.sigmoid or softmax of the router logits",
    "npu_rms_norm_quant": "torch_npu.npu_rms_norm followed by torch_npu.npu_quantize",
    "npu_add_rms_norm_quant": "torch_npu.npu_add_rms_norm followed by torch_npu.npu_quantize",
    "npu_add_rms_norm_cast": "torch_npu.npu_add_rms_norm then .float()",
    "npu_cross_entropy_loss": "torch.nn.functional.cross_entropy",
    "npu_group_norm_silu": "torch.nn.functional.silu(torch.nn.functional.group_norm(x, groups, weight, bias, eps))",
    "npu_group_norm_swish": "torch.nn.functional.silu(torch.nn.functional.group_norm(x, groups, weight, bias, eps))",
    "npu_gelu_mul": "torch.nn.functional.gelu(a) * b over the two halves of the last dim",
    "npu_clipped_swiglu": "a clamped torch_npu.npu_swiglu",
    "npu_top_k_top_p": "torch.topk / torch.sort and a cumulative-probability mask",
    "npu_lstm": "torch.nn.LSTM",
    "npu_gru": "torch.nn.GRU",
    "npu_conv2d": "torch.nn.functional.conv2d",
    "npu_conv3d": "torch.nn.functional.conv3d",
    "npu_conv_transpose2d": "torch.nn.functional.conv_transpose2d",
    "npu_convolution": "torch.nn.functional.conv2d / conv3d",
    "npu_convolution_transpose": "torch.nn.functional.conv_transpose2d / conv_transpose3d",
    "npu_max": "torch.max(x, dim)",
    "npu_min": "torch.min(x, dim)",
    "npu_one_hot": "torch.nn.functional.one_hot",
    "npu_pad": "torch.nn.functional.pad",
    "npu_slice": "tensor slicing x[a:b]",
    "npu_reshape": "torch.reshape",
    "npu_sort_v2": "torch.sort",
    "npu_scatter": "torch.Tensor.scatter",
    "npu_scatter_nd_update": "torch.Tensor.index_put_",
    "npu_scatter_nd_update_": "torch.Tensor.index_put_",
    "npu_softmax_cross_entropy_with_logits": "torch.nn.functional.cross_entropy with probability targets",
    "npu_iou": "torchvision-style box IoU written with torch.max / torch.min",
    "npu_roi_align": "a bilinear-sampling RoIAlign (torch.nn.functional.grid_sample)",
    "npu_multi_head_attention": "torch.nn.functional.multi_head_attention_forward",
    "npu_fused_attention_score": "softmax(q @ k.transpose(-1, -2) * scale + mask) @ v",
    "npu_masked_fill_range": "torch.Tensor.masked_fill over an index range",
    "npu_normalize_batch": "torch.nn.functional.batch_norm statistics",
    "npu_dtype_cast": "torch.Tensor.to(dtype)",
    "npu_indexing": "tensor slicing with strides",
    "npu_stride_add": "torch.add of the two inputs' channel ranges",
    "_npu_dropout": "torch.nn.functional.dropout (its mask: torch.rand_like(x) >= p)",
    "copy_memory_": "dst.copy_(src)",
    "empty_with_format": "torch.empty(size, dtype=dtype, device=device) (acl_format is a storage layout; the emulator keeps ND)",
    "one_": "x.fill_(1)",
    "empty_with_swapped_memory": "torch.empty(size, device='npu') (the emulator's device memory is host memory already)",
    "batch_norm_reduce": "x.sum(dims) and (x * x).sum(dims) over every dim but the channel dim",
    "scatter_update": "data.clone() with updates[i] written at data[i, indices[i]:indices[i] + updates.size(axis)] along axis",
    "scatter_update_": "updates[i] written in place at data[i, indices[i]:indices[i] + updates.size(axis)] along axis",
    "npu_gather_sparse_index": "input[index] (indices into dim 0)",
    "npu_sim_exponential_": "x.exponential_(lambd)",
    "npu_anchor_response_flags": "the anchor responsible flags in torch ops (the feature-map cell holding each gt box's center, "
                                 "as mmdetection's AnchorGenerator.responsible_flags)",
    "npu_bounding_box_decode": "mmdetection's delta2bbox (DeltaXYWHBBoxCoder.decode) in torch ops",
    "npu_bounding_box_encode": "mmdetection's bbox2delta (DeltaXYWHBBoxCoder.encode) in torch ops",
    "npu_yolo_boxes_encode": "mmdetection's YOLOBBoxCoder.encode in torch ops (the wheel's docs print npu_transpose's text for it)",
    "npu_rotated_box_decode": "mmrotate's rotated delta2bbox (DeltaXYWHABBoxCoder.decode) in torch ops",
    "npu_rotated_box_encode": "mmrotate's rotated bbox2delta (DeltaXYWHABBoxCoder.encode) in torch ops",
    "npu_giou": "IoU minus (enclosing area - union) / enclosing area, with torch.max / torch.min over the box corners",
    "npu_diou": "IoU minus center distance squared / enclosing diagonal squared, with torch.max / torch.min",
    "npu_ciou": "DIoU minus alpha * v (the aspect-ratio term with torch.atan), with torch.max / torch.min",
    "npu_ptiou": "intersection area / union area (IoF: / the first box's area), with torch.max / torch.min",
    "npu_rotated_iou": "rotated-box IoU in torch ops (polygon intersection, as mmcv's box_iou_rotated)",
    "npu_rotated_overlaps": "rotated-box overlap area in torch ops (polygon intersection, as mmcv's box_iou_rotated)",
    "npu_batch_nms": "per-class NMS in torch ops: sort by score, drop boxes whose IoU with a kept box exceeds iou_threshold",
    "npu_nms_v4": "NMS in torch ops: sort by score, keep boxes whose IoU with every kept box is <= iou_threshold",
    "npu_nms_with_mask": "NMS in torch ops (pairwise IoU matrix, greedy keep) returning the kept mask",
    "npu_nms_rotated": "NMS in torch ops over the rotated-box IoU",
    "npu_ps_roi_pooling": "position-sensitive RoI pooling in torch ops (torchvision.ops.ps_roi_pool's semantics)",
    "npu_deformable_conv2d": "a deformable convolution in torch ops (torchvision.ops.deform_conv2d's semantics: "
                             "torch.nn.functional.grid_sample at the offset positions, then a matmul with the weight)",
    "npu_grid_assign_positive": "mmdetection's GridAssigner positive assignment in torch ops (torch.where over the overlaps)",
    "npu_random_choice_with_mask": "idx = x.nonzero(); idx[torch.randperm(len(idx))[:count]] with its validity mask",
    "npu_ifmr": "torch.quantile for the min/max percentiles and a search of the clip range in torch ops",
    "npu_sign_bits_pack": "the sign bits of x (x >= 0) packed 8 per uint8 with shifts and a sum, reshaped to (size, -1)",
    "npu_sign_bits_unpack": "the bits of each uint8 ((x >> k) & 1 for k in 0..7) mapped to +1/-1 in dtype, reshaped to (size, -1)",
    "npu_bert_apply_adam": "torch.optim.AdamW's update in torch ops, the gradient first divided by "
                           "max(global_grad_norm / max_grad_norm, 1)",
    "_lstm_npu": "torch.nn.LSTM",
    "_lstm_npu_backward": "autograd of torch.nn.LSTM",
    "npu_batch_gather_matmul": "y + ((x @ weight_a[indices]^T) @ weight_b[indices]^T) * scale, with the per-token weights "
                               "gathered by indices and applied with torch.bmm",
    "npu_batch_gather_matmul_": "y += ((x @ weight_a[indices]^T) @ weight_b[indices]^T) * scale, with the per-token weights "
                                "gathered by indices and applied with torch.bmm",
    "npu_transpose_batchmatmul": "torch.matmul(x1.permute(perm_x1), x2.permute(perm_x2)).permute(perm_y)",
    "npu_transpose_quant_batchmatmul": "torch.matmul of the permuted inputs, dequantised with their scales, then permuted",
    "npu_quant_matmul_reduce_sum": "sum over i of (x1[i].float() @ x2[i].float()) * x1_scale[i, :, None] * x2_scale[None, :]",
    "npu_quant_matmul_gelu": "torch.nn.functional.gelu(torch_npu.npu_quant_matmul(...))",
    "npu_matmul_compress_dequant": "the decompressed weight, then ((x1 @ weight + bias) * scale).half()",
    "npu_grouped_matmul_finalize_routing": "torch_npu.npu_grouped_matmul followed by torch_npu.npu_moe_finalize_routing",
    "npu_grouped_matmul_add": "y_i += x_i^T @ weight_i for each K-axis group of group_list (torch.matmul per group slice)",
    "npu_add_quant_gmm_": "y_i += (x1_i.float() @ x2_i.float()) * scale2_i * scale1_i for each group (torch.matmul per group slice)",
    "npu_grouped_matmul_swiglu_quant": "torch_npu.npu_grouped_matmul (dequantised with weight_scale and x_scale), "
                                       "torch_npu.npu_swiglu, then torch_npu.npu_dynamic_quant",
    "npu_grouped_matmul_swiglu_quant_v2": "torch_npu.npu_grouped_matmul (dequantised with weight_scale and x_scale), "
                                          "torch_npu.npu_swiglu, then torch_npu.npu_dynamic_quant",
    "npu_swiglu_quant": "torch_npu.npu_swiglu followed by torch_npu.npu_dynamic_quant (or npu_quantize for static quant_mode=0)",
    "npu_dequant_swiglu_quant": "x.float() * weight_scale * activation_scale, torch_npu.npu_swiglu, then torch_npu.npu_dynamic_quant",
    "npu_add_rms_norm_dynamic_quant": "torch_npu.npu_add_rms_norm followed by torch_npu.npu_dynamic_quant per smooth scale",
    "npu_rotate_quant": "x @ rotation followed by torch_npu.npu_dynamic_quant",
    "npu_kronecker_quant": "x multiplied by the two small Kronecker matrices (torch.matmul left and right), "
                           "then torch_npu.npu_dynamic_quant",
    "npu_quant_max": "amax = x.abs().amax() (per group of group_list), y = (x * scale).to(dst_type)",
    "npu_dynamic_block_quant": "per (row_block_size x col_block_size) block: scale = block.abs().amax() / the dtype's max, "
                               "y = round(x / scale)",
    "npu_dynamic_mx_quant": "per block_size elements along axis: scale = 2 ** (floor(log2(block.abs().amax())) - emax), "
                            "y = (x / scale).to(dst_type) (OCP MX)",
    "npu_dynamic_mx_quant_with_dual_axis": "npu_dynamic_mx_quant's block scaling on axis -1 and on axis -2, each in torch ops",
    "npu_grouped_dynamic_mx_quant": "npu_dynamic_mx_quant's block scaling within each group of group_index, in torch ops",
    "npu_quant_scatter": "torch_npu.npu_quantize(updates, ...) written into a copy of input along axis at indices",
    "npu_quant_scatter_": "torch_npu.npu_quantize(updates, ...) written into input in place along axis at indices",
    "npu_scatter_pa_kv_cache": "index_put_ of key and value into key_cache / value_cache at the slots slot_mapping names",
    "npu_attention_update": "lse_m = lse_max + log(sum(exp(lse_i - lse_max))); out = sum(O_i * exp(lse_i - lse_m)) over the SP ranks",
    "npu_ring_attention_update": "the docs' rescaling: m = max(prev_max, cur_max), sum = prev_sum * exp(prev_max - m) + "
                                 "cur_sum * exp(cur_max - m), out = the two outputs weighted by their rescaled sums / sum",
    "npu_block_sparse_attention": "torch.nn.functional.scaled_dot_product_attention with block_sparse_mask expanded to a "
                                  "boolean token mask",
    "npu_sparse_flash_attention": "torch.gather of the key/value tokens sparse_indices selects, then "
                                  "torch.nn.functional.scaled_dot_product_attention",
    "npu_kv_quant_sparse_flash_attention": "dequantised key/value, then torch.gather of the tokens sparse_indices selects and "
                                           "torch.nn.functional.scaled_dot_product_attention",
    "npu_lightning_indexer": "torch.topk(sparse_count) over sum_h weights_h * relu(q_h @ k^T), causally masked",
    "npu_quant_lightning_indexer": "dequantised query and key, then torch.topk(sparse_count) over sum_h weights_h * relu(q_h @ k^T)",
    "npu_sparse_lightning_indexer_grad_kl_loss": "autograd of the indexer's scores (sum_h weights_h * relu(q_h @ k^T)) through a "
                                                 "KL-divergence loss against the attention's softmax",
    "npu_dense_lightning_indexer_softmax_lse": "max and torch.logsumexp over the indexer's scores",
    "npu_dense_lightning_indexer_grad_kl_loss": "autograd of the indexer's scores through a KL-divergence loss against the "
                                                "attention's softmax",
    "npu_fused_floyd_attention": "P = softmax(mask(scale * (q_ik @ k_ij^T + q_ik @ k_jk^T))), out = P @ v_ij + P @ v_jk "
                                 "(torch.matmul batched over the sequence axis)",
    "npu_nsa_compress": "the sequence unfolded into blocks of compress_block_size every compress_stride, contracted with weight "
                        "(torch.einsum)",
    "npu_nsa_compress_infer": "the sequence unfolded into blocks of compress_block_size every compress_stride, contracted with "
                              "weight (torch.einsum) and written to the cache at slot_mapping",
    "npu_nsa_compress_attention": "torch.nn.functional.scaled_dot_product_attention over the compressed key/value, and "
                                  "torch.topk of its block scores for the selection",
    "npu_nsa_compress_attention_infer": "torch.nn.functional.scaled_dot_product_attention over the compressed key/value "
                                        "cache, and torch.topk of its block scores",
    "npu_nsa_select_attention": "torch.gather of the key/value blocks topk_indices names, then "
                                "torch.nn.functional.scaled_dot_product_attention",
    "npu_nsa_select_attention_infer": "torch.gather of the cached key/value blocks topk_indices names, then "
                                      "torch.nn.functional.scaled_dot_product_attention",
    "npu_mla_prolog": "the docs' MLA pre-processing in torch ops: rms_norm(x @ weight_dq) @ weight_uq_qr (query; "
                      "torch_npu.npu_rotary_mul on its rope part), rms_norm(x @ weight_dkv) and rope(x @ weight_kr) "
                      "index_put_ into kv_cache / kr_cache",
    "npu_mla_prolog_v2": "npu_mla_prolog's torch ops followed by torch_npu.npu_dynamic_quant of the query",
    "npu_mla_prolog_v3": "npu_mla_prolog's torch ops followed by torch_npu.npu_dynamic_quant of the query",
    "npu_mla_prolog_v3_functional": "npu_mla_prolog's torch ops followed by torch_npu.npu_dynamic_quant of the query",
    "npu_mhc_pre": "the docs' mHC pre formulas in torch ops (x @ phi, rms normalisation, torch.sigmoid gates, Sinkhorn for H_res)",
    "npu_mhc_pre_backward": "autograd of npu_mhc_pre's torch-op formulas",
    "npu_mhc_post": "h_res^T @ x + h_out * h_post (x + h_out * h_post without h_res), torch.matmul",
    "npu_mhc_post_backward": "autograd of h_res^T @ x + h_out * h_post",
    "npu_mhc_sinkhorn": "Sinkhorn in torch ops: exp(x), then rows and columns divided by their sums in turn",
    "npu_mhc_sinkhorn_backward": "autograd of the torch-op Sinkhorn iterations",
    "npu_moe_gating_top_k_softmax_v2": "torch_npu.npu_moe_gating_top_k_softmax (softmax then torch.topk; renorm=1: "
                                       "torch.topk then softmax)",
    "npu_moe_gating_top_k_backward": "autograd of torch.topk over sigmoid / softmax of the router logits",
    "npu_moe_token_permute_with_routing_map": "tokens.index_select(0, routing_map.T.nonzero()[:, 1]) (Megatron's permute "
                                              "with a routing map; probs likewise)",
    "npu_moe_token_unpermute_with_routing_map": "torch.zeros(...).index_add_(0, sorted_indices, permuted_tokens * probs)",
    "npu_moe_update_expert": "torch.gather of eplb_table at the logical expert ids (expert_scales below the threshold pruned)",
    "npu_recurrent_gated_delta_rule": "the gated delta rule recurrence in torch ops (state = g * state + beta * (v - state k) k^T "
                                      "per step, out = state q)",
    "npu_recurrent_gated_delta_rule_functional": "the gated delta rule recurrence in torch ops (state = g * state + "
                                                 "beta * (v - state k) k^T per step, out = state q)",
    "npu_chunk_gated_delta_rule": "the gated delta rule recurrence in torch ops (the chunked form computes the same result)",
    "npu_fused_causal_conv1d": "a depthwise torch.nn.functional.conv1d over the sequence left-padded with conv_states, "
                               "its last tokens written back to conv_states",
    "npu_masked_causal_conv1d": "a depthwise causal torch.nn.functional.conv1d (kernel 3, left padding 2, "
                                "groups = channels) multiplied by mask",
    "npu_masked_causal_conv1d_backward": "autograd of the depthwise causal torch.nn.functional.conv1d",
    "npu_top_k_top_p_sample": "torch.topk / torch.sort with a cumulative-probability mask (top-k, top-p, min-p), then "
                              "torch.multinomial",
    "npu_advance_step_flashattn": "vLLM's advance_step in torch ops: input_tokens = the sampled tokens, input_positions += 1, "
                                  "seq_lens += 1, slot_mapping from block_tables",
    "npu_fused_linear_online_max_sum": "logits = input @ weight^T on the local vocab shard, its max, sum(exp(logits - max)) "
                                       "and the target's logit (Megatron's vocab-parallel cross entropy)",
    "npu_fused_cross_entropy_loss_with_max_sum": "log(sum_exp_logits) + logits_max - predicted_logits (Megatron's "
                                                 "vocab-parallel cross entropy)",
    "npu_fused_linear_cross_entropy_loss_with_max_sum_backward": "autograd of input @ weight^T through the vocab-parallel "
                                                                 "cross entropy",
    "npu_mm_all_reduce_base": "torch.matmul(x1, x2) (+ bias), then torch.distributed.all_reduce",
    "npu_mm_reduce_scatter_base": "torch.matmul(x1, x2) (+ bias), then torch.distributed.reduce_scatter_tensor",
    "npu_quant_mm_reduce_scatter": "a dequantised torch.matmul, then torch.distributed.reduce_scatter_tensor",
    "npu_all_gather_base_mm": "torch.distributed.all_gather_into_tensor of x1, then torch.matmul with x2 (+ bias)",
    "npu_all_gather_quant_mm": "torch.distributed.all_gather_into_tensor of x1, then (x1_scale * x2_scale) * (gathered @ x2 + bias)",
    "npu_alltoallv_gmm": "torch.distributed.all_to_all_single with the send/recv counts, then torch_npu.npu_grouped_matmul",
    "npu_alltoallv_quant_gmm": "torch.distributed.all_to_all_single with the send/recv counts, then a dequantised "
                               "torch_npu.npu_grouped_matmul",
    "npu_gmm_alltoallv": "torch_npu.npu_grouped_matmul, then torch.distributed.all_to_all_single with the send/recv counts",
    "npu_quant_gmm_alltoallv": "a dequantised torch_npu.npu_grouped_matmul, then torch.distributed.all_to_all_single",
}

# Ops with nothing to compute instead: what they are, and what to do on the emulator.
NO_UNFUSED_EQUIVALENT = {
    "npu_prefetch": "it only prefetches weights into the L2 cache and changes no value: drop the call on the emulator",
    "npu_hans_encode": "it is a lossless compression codec for device memory: keep the tensor uncompressed on the emulator",
    "npu_hans_decode": "it is a lossless compression codec for device memory: keep the tensor uncompressed on the emulator",
    "_npu_fused_infer_attention_score_get_max_workspace":
        "it sizes the workspace of npu_fused_infer_attention_score for aclgraph capture: call "
        "torch_npu.npu_fused_infer_attention_score directly",
    "_npu_fused_infer_attention_score_infer_output":
        "it pre-allocates npu_fused_infer_attention_score's outputs for aclgraph capture: call "
        "torch_npu.npu_fused_infer_attention_score directly",
    "_npu_fused_infer_attention_score_v2_get_max_workspace":
        "it sizes the workspace of npu_fused_infer_attention_score_v2 for aclgraph capture: call "
        "torch_npu.npu_fused_infer_attention_score directly",
    "_npu_fused_infer_attention_score_v2_infer_output":
        "it pre-allocates npu_fused_infer_attention_score_v2's outputs for aclgraph capture: call "
        "torch_npu.npu_fused_infer_attention_score directly",
    "ffn_worker_scheduler": "it synchronises attention/FFN-disaggregated serving across devices: run attention and FFN "
                            "in one process on the emulator",
    "ffn_worker_scheduler_": "it synchronises attention/FFN-disaggregated serving across devices: run attention and FFN "
                             "in one process on the emulator",
    "attention_worker_scheduler": "it synchronises attention/FFN-disaggregated serving across devices: run attention and "
                                  "FFN in one process on the emulator",
    "attention_worker_scheduler_": "it synchronises attention/FFN-disaggregated serving across devices: run attention and "
                                   "FFN in one process on the emulator",
    "obfuscation_initialize": "it talks to the PMCC model-obfuscation engine of a trusted execution environment, which "
                              "only an Ascend host has: leave obfuscation off on the emulator",
    "obfuscation_finalize": "it talks to the PMCC model-obfuscation engine of a trusted execution environment, which "
                            "only an Ascend host has: leave obfuscation off on the emulator",
    "obfuscation_calculate": "it talks to the PMCC model-obfuscation engine of a trusted execution environment, which "
                             "only an Ascend host has: leave obfuscation off on the emulator",
}


def what_to_run_instead(name: str) -> str:
    """For a documented op the emulator lacks: the sentence its error (and the docs table) ends with."""
    if name in UNFUSED:
        return f"compute it with its unfused equivalent, {UNFUSED[name]}"
    return f"it has no unfused equivalent: {NO_UNFUSED_EQUIVALENT[name]}"
