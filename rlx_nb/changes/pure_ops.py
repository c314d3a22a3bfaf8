"""The ops a snapshot file may name: pure tensor computations, each called by its public name.

A snapshot written with ``ops=True`` names each op it recorded (``F.softmax``, ``torch.matmul``,
``Tensor.__add__``), and a diff runs the ones it checks alone.  A file is data: the name it carries is looked up
here first, and only a name listed here is ever resolved to a function and called.  Everything on the list takes
tensors and plain values and returns tensors computed from them: no file, network, process, random-number or
Python-object access (``torch.save``, ``torch.load``, ``torch.from_file``, ``torch.manual_seed``, the random
samplers and dropouts, ``Tensor.apply_``/``map_``, hooks, storages, device moves, in-place ops, setters).

The list was made once, on torch 2.13, from the functions a ``TorchFunctionMode`` can see (what a recorder can
have written: ``torch.overrides.get_overridable_functions``), by their public names, keeping the pure ones, and
checked by eye; it is a fixed list, not a rule over what torch has: a function a later torch adds is not on it
until it is added here.  A recorded op that is not on it is written as one that cannot run alone.
"""

from __future__ import annotations

PURE_OPS: frozenset[str] = frozenset(
    """
F.adaptive_avg_pool1d F.adaptive_avg_pool2d F.adaptive_avg_pool3d F.adaptive_max_pool1d F.adaptive_max_pool2d
F.adaptive_max_pool3d F.affine_grid F.avg_pool1d F.avg_pool2d F.avg_pool3d F.batch_norm F.bilinear
F.binary_cross_entropy F.binary_cross_entropy_with_logits F.celu F.channel_shuffle F.conv1d F.conv2d F.conv3d
F.conv_tbc F.conv_transpose1d F.conv_transpose2d F.conv_transpose3d F.cosine_embedding_loss F.cosine_similarity
F.cross_entropy F.ctc_loss F.elu F.embedding F.embedding_bag F.fold F.gaussian_nll_loss F.gelu F.glu F.grid_sample
F.group_norm F.hardshrink F.hardtanh F.hinge_embedding_loss F.huber_loss F.instance_norm F.interpolate F.kl_div
F.l1_loss F.layer_norm F.leaky_relu F.linear F.linear_cross_entropy F.local_response_norm F.log_softmax F.lp_pool1d
F.lp_pool2d F.lp_pool3d F.margin_ranking_loss F.max_pool1d F.max_pool2d F.max_pool3d F.max_unpool1d F.max_unpool2d
F.max_unpool3d F.mish F.mse_loss F.multi_margin_loss F.multilabel_margin_loss F.multilabel_soft_margin_loss
F.native_channel_shuffle F.nll_loss F.normalize F.one_hot F.pad F.pairwise_distance F.pdist F.pixel_shuffle
F.pixel_unshuffle F.poisson_nll_loss F.prelu F.relu F.relu6 F.rms_norm F.scaled_dot_product_attention F.selu F.silu
F.smooth_l1_loss F.soft_margin_loss F.softmax F.softmin F.softplus F.softshrink F.softsign F.tanhshrink
F.triplet_margin_loss F.triplet_margin_with_distance_loss F.unfold Tensor.__add__ Tensor.__and__ Tensor.__div__
Tensor.__eq__ Tensor.__floordiv__ Tensor.__ge__ Tensor.__getitem__ Tensor.__gt__ Tensor.__invert__ Tensor.__le__
Tensor.__lshift__ Tensor.__lt__ Tensor.__matmul__ Tensor.__mod__ Tensor.__mul__ Tensor.__ne__ Tensor.__or__
Tensor.__radd__ Tensor.__rand__ Tensor.__rdiv__ Tensor.__rfloordiv__ Tensor.__rlshift__ Tensor.__rmatmul__
Tensor.__rmod__ Tensor.__rmul__ Tensor.__ror__ Tensor.__rpow__ Tensor.__rrshift__ Tensor.__rshift__ Tensor.__rsub__
Tensor.__rxor__ Tensor.__sub__ Tensor.__truediv__ Tensor.__xor__ Tensor.abs Tensor.absolute Tensor.acos Tensor.acosh
Tensor.add Tensor.addbmm Tensor.addcdiv Tensor.addcmul Tensor.addmm Tensor.addmv Tensor.addr Tensor.adjoint
Tensor.all Tensor.allclose Tensor.amax Tensor.amin Tensor.aminmax Tensor.angle Tensor.any Tensor.arccos
Tensor.arccosh Tensor.arcsin Tensor.arcsinh Tensor.arctan Tensor.arctan2 Tensor.arctanh Tensor.argmax Tensor.argmin
Tensor.argsort Tensor.as_strided_scatter Tensor.asin Tensor.asinh Tensor.atan Tensor.atan2 Tensor.atanh
Tensor.baddbmm Tensor.bitwise_and Tensor.bitwise_left_shift Tensor.bitwise_not Tensor.bitwise_or
Tensor.bitwise_right_shift Tensor.bitwise_xor Tensor.bmm Tensor.ceil Tensor.cholesky Tensor.cholesky_inverse
Tensor.cholesky_solve Tensor.chunk Tensor.clamp Tensor.clamp_max Tensor.clamp_min Tensor.clip Tensor.clone
Tensor.conj Tensor.conj_physical Tensor.contiguous Tensor.copysign Tensor.corrcoef Tensor.cos Tensor.cosh Tensor.cov
Tensor.cross Tensor.cummax Tensor.cummin Tensor.cumprod Tensor.cumsum Tensor.deg2rad Tensor.det Tensor.diag
Tensor.diag_embed Tensor.diagflat Tensor.diagonal Tensor.diagonal_scatter Tensor.diff Tensor.digamma Tensor.dist
Tensor.div Tensor.divide Tensor.dot Tensor.dsplit Tensor.eq Tensor.equal Tensor.erf Tensor.erfc Tensor.erfinv
Tensor.exp Tensor.exp2 Tensor.expand Tensor.expand_as Tensor.expm1 Tensor.fix Tensor.flatten Tensor.flip
Tensor.fliplr Tensor.flipud Tensor.float_power Tensor.floor Tensor.floor_divide Tensor.fmax Tensor.fmin Tensor.fmod
Tensor.frac Tensor.frexp Tensor.gather Tensor.gcd Tensor.ge Tensor.geqrf Tensor.ger Tensor.greater
Tensor.greater_equal Tensor.gt Tensor.hardshrink Tensor.hash_tensor Tensor.heaviside Tensor.hsplit Tensor.hypot
Tensor.i0 Tensor.igamma Tensor.igammac Tensor.index Tensor.index_add Tensor.index_copy Tensor.index_fill
Tensor.index_put Tensor.index_reduce Tensor.index_select Tensor.inner Tensor.inverse Tensor.isclose Tensor.isfinite
Tensor.isinf Tensor.isnan Tensor.isneginf Tensor.isposinf Tensor.isreal Tensor.istft Tensor.kron Tensor.kthvalue
Tensor.lcm Tensor.ldexp Tensor.le Tensor.lerp Tensor.less Tensor.less_equal Tensor.lgamma Tensor.log Tensor.log10
Tensor.log1p Tensor.log2 Tensor.log_softmax Tensor.logaddexp Tensor.logaddexp2 Tensor.logcumsumexp Tensor.logdet
Tensor.logical_and Tensor.logical_not Tensor.logical_or Tensor.logical_xor Tensor.logit Tensor.logsumexp Tensor.lt
Tensor.lu Tensor.lu_solve Tensor.masked_fill Tensor.masked_scatter Tensor.matmul Tensor.matrix_exp
Tensor.matrix_power Tensor.max Tensor.maximum Tensor.mean Tensor.median Tensor.min Tensor.minimum Tensor.mm
Tensor.mode Tensor.moveaxis Tensor.movedim Tensor.msort Tensor.mul Tensor.multiply Tensor.mv Tensor.mvlgamma
Tensor.nan_to_num Tensor.nanmean Tensor.nanmedian Tensor.nanquantile Tensor.nansum Tensor.narrow Tensor.narrow_copy
Tensor.ne Tensor.neg Tensor.negative Tensor.nextafter Tensor.norm Tensor.not_equal Tensor.orgqr Tensor.ormqr
Tensor.outer Tensor.permute Tensor.pinverse Tensor.polygamma Tensor.positive Tensor.pow Tensor.prelu Tensor.prod
Tensor.put Tensor.qr Tensor.quantile Tensor.rad2deg Tensor.ravel Tensor.reciprocal Tensor.relu Tensor.remainder
Tensor.renorm Tensor.repeat Tensor.repeat_interleave Tensor.reshape Tensor.reshape_as Tensor.resize_as
Tensor.resolve_conj Tensor.resolve_neg Tensor.roll Tensor.rot90 Tensor.round Tensor.rsqrt Tensor.scatter
Tensor.scatter_add Tensor.scatter_reduce Tensor.select Tensor.select_scatter Tensor.sgn Tensor.sigmoid Tensor.sign
Tensor.signbit Tensor.sin Tensor.sinc Tensor.sinh Tensor.slice_inverse Tensor.slice_scatter Tensor.slogdet
Tensor.smm Tensor.softmax Tensor.sort Tensor.split Tensor.split_with_sizes Tensor.sqrt Tensor.square Tensor.squeeze
Tensor.sspaddmm Tensor.std Tensor.stft Tensor.sub Tensor.subtract Tensor.sum Tensor.svd Tensor.swapaxes
Tensor.swapdims Tensor.t Tensor.take Tensor.tan Tensor.tanh Tensor.tensor_split Tensor.tile Tensor.topk Tensor.trace
Tensor.transpose Tensor.triangular_solve Tensor.tril Tensor.triu Tensor.true_divide Tensor.trunc Tensor.type_as
Tensor.unbind Tensor.unfold Tensor.unsafe_chunk Tensor.unsafe_split Tensor.unsafe_split_with_sizes Tensor.unsqueeze
Tensor.var Tensor.vdot Tensor.view Tensor.view_as Tensor.vsplit Tensor.xlogy torch.abs torch.absolute torch.acos
torch.acosh torch.adaptive_max_pool1d torch.add torch.addbmm torch.addcdiv torch.addcmul torch.addmm torch.addmv
torch.addr torch.adjoint torch.affine_grid_generator torch.alias_copy torch.all torch.allclose torch.amax torch.amin
torch.aminmax torch.angle torch.any torch.arccos torch.arccosh torch.arcsin torch.arcsinh torch.arctan torch.arctan2
torch.arctanh torch.argmax torch.argmin torch.argsort torch.as_strided_copy torch.as_strided_scatter torch.asin
torch.asinh torch.atan torch.atan2 torch.atanh torch.atleast_1d torch.atleast_2d torch.atleast_3d torch.baddbmm
torch.batch_norm torch.batch_norm_backward_elemt torch.batch_norm_backward_reduce torch.batch_norm_elemt
torch.batch_norm_gather_stats torch.batch_norm_gather_stats_with_counts torch.batch_norm_stats
torch.batch_norm_update_stats torch.binary_cross_entropy_with_logits torch.bitwise_and torch.bitwise_left_shift
torch.bitwise_not torch.bitwise_or torch.bitwise_right_shift torch.bitwise_xor torch.block_diag torch.bmm
torch.broadcast_tensors torch.bucketize torch.cartesian_prod torch.cat torch.ccol_indices_copy torch.cdist
torch.ceil torch.celu torch.chain_matmul torch.cholesky torch.cholesky_inverse torch.cholesky_solve torch.chunk
torch.clamp torch.clamp_max torch.clamp_min torch.clip torch.clone torch.col_indices_copy torch.column_stack
torch.combinations torch.complex torch.concat torch.concatenate torch.conj torch.conj_physical torch.constant_pad_nd
torch.convolution torch.copysign torch.corrcoef torch.cos torch.cosh torch.cosine_embedding_loss torch.cov
torch.cross torch.crow_indices_copy torch.ctc_loss torch.cummax torch.cummin torch.cumprod torch.cumsum
torch.cumulative_trapezoid torch.deg2rad torch.det torch.detach_copy torch.diag torch.diag_embed torch.diagflat
torch.diagonal torch.diagonal_copy torch.diagonal_scatter torch.diff torch.digamma torch.dist torch.div torch.divide
torch.dot torch.dsmm torch.dsplit torch.dstack torch.einsum torch.embedding torch.embedding_bag torch.eq torch.equal
torch.erf torch.erfc torch.erfinv torch.exp torch.exp2 torch.expand_copy torch.expm1 torch.fix torch.flatten
torch.flip torch.fliplr torch.flipud torch.float_power torch.floor torch.floor_divide torch.fmax torch.fmin
torch.fmod torch.frac torch.frexp torch.frobenius_norm torch.full_like torch.gather torch.gcd torch.ge torch.geqrf
torch.ger torch.gradient torch.greater torch.greater_equal torch.grid_sampler torch.grid_sampler_2d
torch.grid_sampler_3d torch.group_norm torch.gru_cell torch.gt torch.hash_tensor torch.heaviside
torch.hinge_embedding_loss torch.hsmm torch.hsplit torch.hspmm torch.hstack torch.hypot torch.i0 torch.igamma
torch.igammac torch.index_add torch.index_copy torch.index_fill torch.index_put torch.index_reduce
torch.index_select torch.indices_copy torch.inner torch.instance_norm torch.inverse torch.isclose torch.isfinite
torch.isin torch.isinf torch.isnan torch.isneginf torch.isposinf torch.isreal torch.istft torch.kl_div torch.kron
torch.kthvalue torch.layer_norm torch.lcm torch.ldexp torch.le torch.lerp torch.less torch.less_equal torch.lgamma
torch.log torch.log10 torch.log1p torch.log2 torch.log_softmax torch.logaddexp torch.logaddexp2 torch.logcumsumexp
torch.logdet torch.logical_and torch.logical_not torch.logical_or torch.logical_xor torch.logit torch.logsumexp
torch.lstm_cell torch.lt torch.lu torch.lu_solve torch.lu_unpack torch.margin_ranking_loss torch.masked_fill
torch.masked_scatter torch.matmul torch.matrix_exp torch.matrix_power torch.max torch.max_pool1d torch.max_pool2d
torch.max_pool3d torch.maximum torch.mean torch.median torch.meshgrid torch.min torch.minimum torch.mm torch.mode
torch.moveaxis torch.movedim torch.msort torch.mul torch.multiply torch.mv torch.mvlgamma torch.nan_to_num
torch.nanmean torch.nanmedian torch.nanquantile torch.nansum torch.narrow torch.narrow_copy torch.native_batch_norm
torch.native_group_norm torch.native_layer_norm torch.native_norm torch.ne torch.neg torch.negative torch.nextafter
torch.norm torch.not_equal torch.nuclear_norm torch.ones_like torch.orgqr torch.ormqr torch.outer torch.permute
torch.permute_copy torch.pinverse torch.poisson_nll_loss torch.polar torch.polygamma torch.positive torch.pow
torch.prod torch.put torch.qr torch.quantile torch.rad2deg torch.ravel torch.reciprocal torch.relu torch.remainder
torch.renorm torch.repeat_interleave torch.reshape torch.resolve_conj torch.resolve_neg torch.rms_norm
torch.rnn_relu_cell torch.rnn_tanh_cell torch.roll torch.rot90 torch.round torch.row_indices_copy torch.row_stack
torch.rsqrt torch.rsub torch.saddmm torch.scatter torch.scatter_add torch.scatter_reduce torch.searchsorted
torch.select torch.select_copy torch.select_scatter torch.selu torch.sgn torch.sigmoid torch.sign torch.signbit
torch.sin torch.sinc torch.sinh torch.slice_copy torch.slice_inverse torch.slice_scatter torch.slogdet torch.smm
torch.softmax torch.sort torch.split torch.split_copy torch.split_with_sizes torch.split_with_sizes_copy torch.spmm
torch.sqrt torch.square torch.squeeze torch.squeeze_copy torch.sspaddmm torch.stack torch.std torch.std_mean
torch.stft torch.sub torch.subtract torch.sum torch.svd torch.swapaxes torch.swapdims torch.t torch.t_copy
torch.take torch.tan torch.tanh torch.tensor_split torch.tensordot torch.threshold torch.tile torch.topk torch.trace
torch.transpose torch.transpose_copy torch.trapezoid torch.trapz torch.triangular_solve torch.tril
torch.triplet_margin_loss torch.triu torch.true_divide torch.trunc torch.unbind torch.unbind_copy torch.unflatten
torch.unfold_copy torch.unravel_index torch.unsafe_chunk torch.unsafe_split torch.unsafe_split_with_sizes
torch.unsqueeze torch.unsqueeze_copy torch.values_copy torch.var torch.var_mean torch.vdot torch.view_as_complex
torch.view_as_complex_copy torch.view_as_real_copy torch.view_copy torch.vsplit torch.vstack torch.xlogy
torch.zeros_like
""".split()
)
"""The public names of the ops a snapshot may have a diff run (see the module docstring)."""

__all__ = ["PURE_OPS"]
