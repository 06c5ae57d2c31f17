"""Every case of shared/reference/tricky_cases.md as an (input, expected output, expected flags) triple.

Case ids follow the reference numbering (A01 = case 1 ...). Where a case is about non-Python files
(44, 63) or the whole tree (68) it lives in test_textfiles.py / test_runner.py; the entry here
checks the Python side of it.
"""

from __future__ import annotations

import textwrap

import pytest

from npukit.migrate.pysource import migrate_python

NPU = "import torch_npu\n"


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# (id, input, expected output, finding kinds that must be reported)
CASES = [
    # ---------------------------------------------------------------- A. device selection and strings
    ("A01-device-ifexp",
     'import torch\ndevice = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n',
     NPU + 'import torch\ndevice = torch.device("npu" if torch.npu.is_available() else "cpu")\n', set()),
    ("A02-device-with-index",
     'import torch\nd = torch.device("cuda", local_rank)\n',
     NPU + 'import torch\nd = torch.device("npu", local_rank)\n', set()),
    ("A03-fstring-device",
     'import torch\nx = t.to(f"cuda:{rank}")\nname = f"cuda:{rank}"\n',
     NPU + 'import torch\nx = t.to(f"npu:{rank}")\nname = f"npu:{rank}"\n', set()),
    ("A03-fstring-docstring-untouched",
     'def f():\n    """Runs on f"cuda:{rank}" devices."""\n    print(f"cuda:{rank} ready")\n',
     'def f():\n    """Runs on f"cuda:{rank}" devices."""\n    print(f"cuda:{rank} ready")\n', set()),
    ("A04-percent-format-concat",
     'import torch\na = torch.device("cuda:%d" % i)\nb = t.to("cuda:{}".format(i))\nc = t.to("cuda:" + str(i))\n',
     NPU + 'import torch\na = torch.device("npu:%d" % i)\nb = t.to("npu:{}".format(i))\nc = t.to("npu:" + str(i))\n',
     set()),
    ("A05-variable-flows-into-sink",
     'import torch\ndef main():\n    dev = "cuda"\n    model.to(dev)\n',
     NPU + 'import torch\ndef main():\n    dev = "npu"\n    model.to(dev)\n', set()),
    ("A05-unrelated-variable-and-dict-key-flagged-not-rewritten",
     'import torch\nlog_msg = "cuda"\nflags = {"cuda": True}\n',
     'import torch\nlog_msg = "cuda"\nflags = {"cuda": True}\n', {"device-string"}),
    ("A06-comparisons",
     _src('''
        import torch
        a = x.device.type == "cuda"
        b = args.device == "cuda"
        c = str(x.device).startswith("cuda")
        d = device.type in ("cuda", "mps")
        '''),
     NPU + _src('''
        import torch
        a = x.device.type == "npu"
        b = args.device == "npu"
        c = str(x.device).startswith("npu")
        d = device.type in ("npu", "mps")
        '''), set()),
    ("A07-argparse-default-and-choices",
     'p.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="use cuda")\n',
     'p.add_argument("--device", default="npu", choices=["cpu", "npu"], help="use cuda")\n', set()),
    ("A08-cuda-cli-flag-kept",
     'p.add_argument("--cuda", action="store_true")\nif args.cuda:\n    model.cuda()\n',
     'p.add_argument("--cuda", action="store_true")\nif args.cuda:\n    model.npu()\n', {"cli-flag"}),
    ("A09-docstring-comment-log-untouched",
     '"""Runs on cuda:0."""\nimport logging\n# move to cuda\nlogging.info("using cuda")\nprint("cuda:0 ready")\n',
     '"""Runs on cuda:0."""\nimport logging\n# move to cuda\nlogging.info("using cuda")\nprint("cuda:0 ready")\n',
     set()),
    ("A10-visible-devices",
     'import os\nos.environ["CUDA_VISIBLE_DEVICES"] = "0,1"\nv = os.environ.get("CUDA_VISIBLE_DEVICES")\n',
     'import os\nos.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0,1"\nv = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")\n',
     {"visible-devices"}),
    ("A11-other-env-vars",
     _src('''
        import os
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        '''),
     _src('''
        import os
        os.environ["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"
        os.environ["ASCEND_LAUNCH_BLOCKING"] = "1"
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        '''), {"env-var"}),
    ("A12-default-device-and-context",
     'import torch\ntorch.set_default_device("cuda")\nwith torch.device("cuda"):\n    pass\n',
     NPU + 'import torch\ntorch.set_default_device("npu")\nwith torch.device("npu"):\n    pass\n', set()),
    ("A13-set-default-tensor-type",
     'import torch\ntorch.set_default_tensor_type(torch.cuda.HalfTensor)\n',
     NPU + 'import torch\ntorch.set_default_device("npu")\ntorch.set_default_dtype(torch.float16)\n', set()),
    # ---------------------------------------------------------------- B. moving data / modules
    ("B14-cuda-method-forms",
     'import torch\na = x.cuda()\nb = x.cuda(non_blocking=True)\nc = x.cuda(local_rank)\nmove = x.cuda\n',
     NPU + 'import torch\na = x.npu()\nb = x.npu(non_blocking=True)\nc = x.npu(local_rank)\nmove = x.npu\n', set()),
    ("B14-user-class-cuda-method-kept",
     _src('''
        class Foo:
            def cuda(self):
                return 1
            def run(self):
                return self.cuda()
        y = Foo().cuda()
        f = Foo()
        z = f.cuda()
        '''),
     _src('''
        class Foo:
            def cuda(self):
                return 1
            def run(self):
                return self.cuda()
        y = Foo().cuda()
        f = Foo()
        z = f.cuda()
        '''), {"user-cuda-method"}),
    ("B15-to-forms",
     'model.to("cuda")\nx.to(device="cuda:1")\nx.to("cuda", non_blocking=True)\n',
     'model.to("npu")\nx.to(device="npu:1")\nx.to("npu", non_blocking=True)\n', set()),
    ("B16-int-ordinals",
     'import torch\na = x.to(0)\nb = x.to(local_rank)\nc = torch.zeros(2, device=args.gpu)\nd = torch.device(local_rank)\n',
     NPU + 'import torch\na = x.to("npu:0")\nb = x.to(f"npu:{local_rank}")\nc = torch.zeros(2, device=f"npu:{args.gpu}")\n'
     'd = torch.device("npu", local_rank)\n', set()),
    ("B17-to-device-object-unchanged",
     'import torch\ndef f(model, device: torch.device):\n    return model.to(device)\n',
     'import torch\ndef f(model, device: torch.device):\n    return model.to(device)\n', set()),
    ("B18-pin-memory",
     'from torch.utils.data import DataLoader\nx.pin_memory()\nDataLoader(ds, pin_memory=True, pin_memory_device="cuda")\n',
     NPU + 'from torch.utils.data import DataLoader\nx.pin_memory()\nDataLoader(ds, pin_memory=True, pin_memory_device="npu")\n',
     set()),
    ("B19-map-location-forms",
     _src('''
        import torch
        a = torch.load(f, map_location="cuda:0")
        b = torch.load(f, map_location={"cuda:1": "cuda:0"})
        c = torch.load(f, map_location=lambda s, l: s.cuda(rank))
        d = torch.load(f, map_location=torch.device("cuda"))
        '''),
     NPU + _src('''
        import torch
        a = torch.load(f, map_location="npu:0")
        b = torch.load(f, map_location={"npu:1": "npu:0"})
        c = torch.load(f, map_location=lambda s, l: s.npu(rank))
        d = torch.load(f, map_location=torch.device("npu"))
        '''), set()),
    ("B20-torch-load-without-map-location",
     'import torch\nstate = torch.load("ckpt.pt")\nmodel.load_state_dict(state)\nother = torch.load("o.pt")\n',
     'import torch_npu\nimport torch\nstate = torch.load("ckpt.pt", map_location="cpu")\nmodel.load_state_dict(state)\n'
     'other = torch.load("o.pt", map_location="npu")\n', {"torch-load"}),
    ("B21-is-cuda",
     'import torch\nif x.is_cuda and s.untyped_storage().is_cuda:\n    pass\n',
     NPU + 'import torch\nif x.is_npu and s.untyped_storage().is_npu:\n    pass\n', set()),
    ("B22-legacy-tensor-types",
     'import torch\na = torch.cuda.FloatTensor(2)\nb = torch.cuda.LongTensor(2)\nc = torch.cuda.DoubleTensor(2)\n',
     NPU + 'import torch\na = torch.npu.FloatTensor(2)\nb = torch.npu.LongTensor(2)\nc = torch.npu.DoubleTensor(2)\n',
     {"fp64"}),
    # ---------------------------------------------------------------- C. torch.cuda namespace
    ("C23-aliased-module-import",
     'import torch.cuda as tc\nn = tc.device_count()\n',
     NPU + 'import torch_npu.npu as tc\nn = tc.device_count()\n', set()),
    ("C24-amp-imports-upgraded",
     _src('''
        from torch.cuda.amp import autocast, GradScaler
        scaler = GradScaler()
        with autocast():
            pass
        '''),
     NPU + _src('''
        from torch.amp import autocast, GradScaler
        scaler = GradScaler("npu")
        with autocast("npu"):
            pass
        '''), set()),
    ("C24-amp-module-import",
     'from torch.cuda import amp\nwith amp.autocast(enabled=True):\n    pass\n',
     NPU + 'from torch import amp\nwith amp.autocast("npu", enabled=True):\n    pass\n', set()),
    ("C24-amp-import-used-as-value-falls-back",
     'from torch.cuda.amp import GradScaler\nfactory = GradScaler\n',
     NPU + 'from torch_npu.npu.amp import GradScaler\nfactory = GradScaler\n', set()),
    ("C25-same-name-functions",
     _src('''
        import torch
        torch.cuda.set_device(rank)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        m = torch.cuda.max_memory_allocated()
        torch.cuda.manual_seed_all(0)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            pass
        torch.cuda.memory._record_memory_history()
        '''),
     NPU + _src('''
        import torch
        torch.npu.set_device(rank)
        torch.npu.synchronize()
        torch.npu.empty_cache()
        m = torch.npu.max_memory_allocated()
        torch.npu.manual_seed_all(0)
        s = torch.npu.Stream()
        with torch.npu.stream(s):
            pass
        torch.npu.memory._record_memory_history()
        '''), set()),
    ("C26-renamed",
     'import torch\ng = torch.cuda.CUDAGraph()\ngens = torch.cuda.default_generators\n',
     NPU + 'import torch\ng = torch.npu.NPUGraph()\ngens = torch_npu.npu.default_generators\n', set()),
    ("C27-no-equivalent-flagged",
     'import torch\nfrom torch.cuda import nccl\ntorch.cuda.comm.broadcast(t, devices)\nu = torch.cuda.memory_usage()\n',
     'import torch\nfrom torch.cuda import nccl\ntorch.cuda.comm.broadcast(t, devices)\nu = torch.cuda.memory_usage()\n',
     {"no-equivalent"}),
    ("C28-device-capability-flagged",
     'import torch\nif torch.cuda.get_device_capability()[0] >= 8:\n    pass\n',
     'import torch\nif torch.cuda.get_device_capability()[0] >= 8:\n    pass\n', {"device-capability"}),
    ("C29-device-properties-major-flagged",
     'import torch\np = torch.cuda.get_device_properties(0)\nok = p.major >= 8\nmem = p.total_memory\n',
     NPU + 'import torch\np = torch.npu.get_device_properties(0)\nok = p.major >= 8\nmem = p.total_memory\n',
     {"device-properties"}),
    ("C30-device-name-parsed-flagged",
     'import torch\nif "A100" in torch.cuda.get_device_name():\n    pass\n',
     NPU + 'import torch\nif "A100" in torch.npu.get_device_name():\n    pass\n', {"device-name"}),
    ("C31-version-gates-flagged",
     'import torch\nif torch.version.cuda and torch.backends.cudnn.version() > 8000:\n    pass\n',
     'import torch\nif torch.version.cuda and torch.backends.cudnn.version() > 8000:\n    pass\n', {"version-gate"}),
    ("C32-nvtx-to-mstx",
     _src('''
        import torch
        torch.cuda.nvtx.range_push("fwd")
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.mark("x")
        with torch.cuda.nvtx.range("step"):
            pass
        with torch.autograd.profiler.emit_nvtx():
            pass
        '''),
     NPU + _src('''
        import torch
        torch.npu.mstx.range_push("fwd")
        torch.npu.mstx.range_pop()
        torch.npu.mstx.mark("x")
        with torch.npu.mstx.mstx_range("step"):
            pass
        with torch.autograd.profiler.emit_nvtx():
            pass
        '''), {"nvtx"}),
    # ---------------------------------------------------------------- D. AMP
    ("D33-autocast-bf16",
     'import torch\nwith torch.cuda.amp.autocast(dtype=torch.bfloat16):\n    pass\nwith torch.cuda.amp.autocast(True):\n    pass\n',
     NPU + 'import torch\nwith torch.amp.autocast("npu", dtype=torch.bfloat16):\n    pass\n'
     'with torch.amp.autocast("npu", enabled=True):\n    pass\n', {"bf16"}),
    ("D34-generic-autocast-strings",
     _src('''
        import torch
        with torch.autocast(device_type="cuda"):
            pass
        with torch.amp.autocast("cuda"):
            pass
        s = torch.amp.GradScaler("cuda")
        e = torch.is_autocast_enabled("cuda")
        d = torch.get_autocast_gpu_dtype()
        '''),
     NPU + _src('''
        import torch
        with torch.autocast(device_type="npu"):
            pass
        with torch.amp.autocast("npu"):
            pass
        s = torch.amp.GradScaler("npu")
        e = torch.is_autocast_enabled("npu")
        d = torch.get_autocast_dtype("npu")
        '''), set()),
    ("D35-custom-fwd-bwd",
     _src('''
        import torch
        class F(torch.autograd.Function):
            @staticmethod
            @torch.cuda.amp.custom_fwd(cast_inputs=torch.float16)
            def forward(ctx, x):
                return x
            @staticmethod
            @torch.cuda.amp.custom_bwd
            def backward(ctx, g):
                return g
        '''),
     NPU + _src('''
        import torch
        class F(torch.autograd.Function):
            @staticmethod
            @torch.amp.custom_fwd(cast_inputs=torch.float16, device_type="npu")
            def forward(ctx, x):
                return x
            @staticmethod
            @torch.amp.custom_bwd(device_type="npu")
            def backward(ctx, g):
                return g
        '''), set()),
    ("D36-apex-amp-flagged",
     'from apex import amp\nmodel, opt = amp.initialize(model, opt, opt_level="O1")\n',
     'from apex import amp\nmodel, opt = amp.initialize(model, opt, opt_level="O1")\n', {"apex"}),
    # ---------------------------------------------------------------- E. distributed
    ("E37-backend-strings",
     'import torch.distributed as dist\ndist.init_process_group("nccl")\ndist.init_process_group(backend="cuda:nccl,cpu:gloo")\n',
     NPU + 'import torch.distributed as dist\ndist.init_process_group("hccl")\ndist.init_process_group(backend="npu:hccl,cpu:gloo")\n',
     set()),
    ("E38-backend-comparisons",
     _src('''
        import torch.distributed as dist
        a = dist.get_backend() == "nccl"
        assert backend in ["gloo", "nccl"]
        if args.dist_backend == "nccl":
            pass
        '''),
     NPU + _src('''
        import torch.distributed as dist
        a = dist.get_backend() == "hccl"
        assert backend in ["gloo", "hccl"]
        if args.dist_backend == "hccl":
            pass
        '''), set()),
    ("E39-backend-from-argparse",
     'import torch.distributed as dist\np.add_argument("--dist-backend", default="nccl")\ndist.init_process_group(backend=args.dist_backend)\n',
     NPU + 'import torch.distributed as dist\np.add_argument("--dist-backend", default="hccl")\n'
     'dist.init_process_group(backend=args.dist_backend)\n', {"backend-string"}),
    ("E40-nccl-available-and-process-group",
     'import torch.distributed as dist\nok = dist.is_nccl_available()\npg = dist.ProcessGroupNCCL\n',
     NPU + 'import torch.distributed as dist\nok = dist.is_hccl_available()\npg = dist.ProcessGroupNCCL\n', {"nccl"}),
    ("E41-ddp-ints-unchanged",
     'from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model, device_ids=[local_rank], output_device=local_rank)\n',
     'from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model, device_ids=[local_rank], output_device=local_rank)\n',
     {"ddp-set-device"}),
    ("E42-data-parallel-flagged",
     'import torch.nn as nn\nm = nn.DataParallel(model)\n',
     'import torch.nn as nn\nm = nn.DataParallel(model)\n', {"data-parallel"}),
    ("E43-device-mesh-and-fsdp",
     _src('''
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (2, 4))
        m = FSDP(model, device_id=torch.cuda.current_device())
        '''),
     NPU + _src('''
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("npu", (2, 4))
        m = FSDP(model, device_id=torch.npu.current_device())
        '''), set()),
    ("E44-launcher-env-in-python",
     'import subprocess\nsubprocess.run(["torchrun", "train.py"], env={"CUDA_VISIBLE_DEVICES": "0,1"})\n',
     'import subprocess\nsubprocess.run(["torchrun", "train.py"], env={"ASCEND_RT_VISIBLE_DEVICES": "0,1"})\n',
     {"visible-devices"}),
    # ---------------------------------------------------------------- F. backends / numerics
    ("F45-cudnn-flags-kept",
     'import torch\ntorch.backends.cudnn.benchmark = True\ntorch.backends.cudnn.deterministic = True\n',
     'import torch\ntorch.backends.cudnn.benchmark = True\ntorch.backends.cudnn.deterministic = True\n', {"no-op"}),
    ("F46-tf32-to-hf32",
     'import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\ntorch.backends.cudnn.allow_tf32 = True\n'
     'torch.set_float32_matmul_precision("high")\n',
     NPU + 'import torch\ntorch.npu.matmul.allow_hf32 = True\ntorch.npu.conv.allow_hf32 = True\n'
     'torch.set_float32_matmul_precision("high")\n', {"precision"}),
    ("F47-sdp-kernel-flagged",
     'import torch\nwith torch.backends.cuda.sdp_kernel(enable_flash=True):\n    pass\ntorch.backends.cuda.enable_flash_sdp(True)\n',
     'import torch\nwith torch.backends.cuda.sdp_kernel(enable_flash=True):\n    pass\ntorch.backends.cuda.enable_flash_sdp(True)\n',
     {"unsupported-api"}),
    ("F48-channels-last-flagged",
     'import torch\nx = x.to(memory_format=torch.channels_last)\n',
     'import torch\nx = x.to(memory_format=torch.channels_last)\n', {"channels-last"}),
    # ---------------------------------------------------------------- G. compilation / extensions
    ("G49-jit-script-flagged",
     'import torch\n@torch.jit.script\ndef f(x):\n    return x\n',
     'import torch\n@torch.jit.script\ndef f(x):\n    return x\n', {"torchscript"}),
    ("G50-compile-flagged",
     'import torch\nm = torch.compile(model, mode="reduce-overhead")\n',
     'import torch\nm = torch.compile(model, mode="reduce-overhead")\n', {"compile"}),
    ("G51-cuda-extension-flagged",
     _src('''
        from torch.utils.cpp_extension import CUDAExtension, BuildExtension, load
        ext = CUDAExtension("k", ["k.cu"])
        mod = load(name="k", sources=["k.cu"])
        '''),
     _src('''
        from torch.utils.cpp_extension import CUDAExtension, BuildExtension, load
        ext = CUDAExtension("k", ["k.cu"])
        mod = load(name="k", sources=["k.cu"])
        '''), {"cuda-extension"}),
    ("G52-custom-op-module-flagged",
     'from torch.utils.cpp_extension import load_inline\nm = load_inline(name="m", cpp_sources=c, cuda_sources=k)\n',
     'from torch.utils.cpp_extension import load_inline\nm = load_inline(name="m", cpp_sources=c, cuda_sources=k)\n',
     {"cuda-extension"}),
    # ---------------------------------------------------------------- H. third-party GPU-only libraries
    ("H53-flash-attn-flagged",
     'from flash_attn import flash_attn_func\no = flash_attn_func(q, k, v, causal=True)\n',
     'from flash_attn import flash_attn_func\no = flash_attn_func(q, k, v, causal=True)\n', {"flash-attn"}),
    ("H54-xformers-flagged",
     'import xformers.ops as xops\no = xops.memory_efficient_attention(q, k, v)\n',
     'import xformers.ops as xops\no = xops.memory_efficient_attention(q, k, v)\n', {"xformers"}),
    ("H55-triton-flagged",
     'import triton\n@triton.jit\ndef kernel(x):\n    pass\n',
     'import triton\n@triton.jit\ndef kernel(x):\n    pass\n', {"triton"}),
    ("H56-bitsandbytes-flagged",
     'import bitsandbytes as bnb\nopt = bnb.optim.Adam8bit(params)\n',
     'import bitsandbytes as bnb\nopt = bnb.optim.Adam8bit(params)\n', {"bitsandbytes"}),
    ("H57-apex-fused-flagged",
     'from apex.optimizers import FusedAdam\nimport amp_C\nopt = FusedAdam(params)\n',
     'from apex.optimizers import FusedAdam\nimport amp_C\nopt = FusedAdam(params)\n', {"apex"}),
    ("H58-cupy-numba-flagged",
     'import cupy as cp\nfrom numba import cuda\n@cuda.jit\ndef k(a):\n    pass\n',
     'import cupy as cp\nfrom numba import cuda\n@cuda.jit\ndef k(a):\n    pass\n', {"cupy", "numba-cuda"}),
    ("H59-nvml-and-nvidia-smi-flagged",
     'import os\nimport subprocess\nimport pynvml\nsubprocess.run(["nvidia-smi", "-L"])\nos.system("nvidia-smi")\n',
     'import os\nimport subprocess\nimport pynvml\nsubprocess.run(["nvidia-smi", "-L"])\nos.system("nvidia-smi")\n',
     {"nvml", "nvidia-smi"}),
    ("H60-library-device-logic-untouched",
     'from accelerate import Accelerator\nacc = Accelerator()\nmodel = acc.prepare(model)\n',
     'from accelerate import Accelerator\nacc = Accelerator()\nmodel = acc.prepare(model)\n', set()),
    # ---------------------------------------------------------------- I. repository-level mechanics
    ("I61-import-after-docstring-and-future",
     '"""Doc."""\nfrom __future__ import annotations\nimport torch\nx = torch.zeros(1).cuda()\n',
     '"""Doc."""\nfrom __future__ import annotations\nimport torch_npu\nimport torch\nx = torch.zeros(1).npu()\n', set()),
    ("I61-import-not-duplicated",
     'import torch\nimport torch_npu\nx = torch.zeros(1).cuda()\n',
     'import torch\nimport torch_npu\nx = torch.zeros(1).npu()\n', set()),
    ("I62-plain-import-inserted",
     'import torch\ntorch.cuda.synchronize()\n',
     NPU + 'import torch\ntorch.npu.synchronize()\n', set()),
    ("I63-notebook-magic-is-python-side-noop",
     'import torch\nx = 1\n',
     'import torch\nx = 1\n', set()),
    ("I64-formatting-preserved",
     'import torch\nx = torch.zeros( 2 ,\n    3 ).cuda(  )   # keep   me\ny = torch.cuda.is_available()  ;  z = 1\n',
     NPU + 'import torch\nx = torch.zeros( 2 ,\n    3 ).npu(  )   # keep   me\ny = torch.npu.is_available()  ;  z = 1\n', set()),
    ("I65-dual-target-if-kept",
     _src('''
        import torch
        if torch.cuda.is_available():
            dev = "cuda"
        elif torch.npu.is_available():
            dev = "npu"
        '''),
     _src('''
        import torch
        if torch.cuda.is_available():
            dev = "cuda"
        elif torch.npu.is_available():
            dev = "npu"
        '''), {"dual-target"}),
    ("I66-aliases-and-star",
     _src('''
        import torch as th
        from torch import cuda
        from torch.cuda import *
        th.cuda.synchronize()
        n = cuda.device_count()
        '''),
     NPU + _src('''
        import torch as th
        from torch_npu import npu as cuda
        from torch_npu.npu import *
        th.npu.synchronize()
        n = cuda.device_count()
        '''), set()),
    ("I67-fork-rng-device-type",
     'import torch\nwith torch.random.fork_rng(devices):\n    pass\n',
     NPU + 'import torch\nwith torch.random.fork_rng(devices, device_type="npu"):\n    pass\n', set()),
    ("I68-no-cuda-byte-identical",
     '"""A module that never touches CUDA."""\nimport torch\nx = torch.zeros(3)\n',
     '"""A module that never touches CUDA."""\nimport torch\nx = torch.zeros(3)\n', set()),
]


@pytest.mark.parametrize(("case_id", "source", "expected", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_tricky_case(case_id: str, source: str, expected: str, kinds: set[str]) -> None:
    outcome = migrate_python(source, "case.py")
    assert outcome.text == expected
    reported = {f.kind for f in outcome.findings}
    assert kinds <= reported, f"missing findings {kinds - reported}; got {reported}"


@pytest.mark.parametrize(("case_id", "source", "expected", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_second_run_changes_nothing(case_id: str, source: str, expected: str, kinds: set[str]) -> None:
    once = migrate_python(source, "case.py").text
    assert migrate_python(once, "case.py").text == once


def test_every_reference_case_is_covered() -> None:
    numbers = {int(case_id[1:3]) for case_id, *_ in CASES}
    assert numbers == set(range(1, 69))
