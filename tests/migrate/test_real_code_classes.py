"""Classes of migration mistakes found on open-source repositories, as minimal reproductions.

Each case is (input, expected output, expected finding kinds): what the rewrite must produce, and
what must be reported so that nothing CUDA is left silently (the audit: codemods/leftovers.py).
"""

from __future__ import annotations

import pytest

from npukit.migrate.pysource import migrate_python

NPU = "import torch_npu\n"

CASES = [
    # 1. a name bound by `import model`, rebound to the model: decided per use site
    ("module-name-rebound-to-a-model",
     "import torch\nimport model\nmodel = model.RNNModel(10, 20)\nmodel = model.cuda()\n",
     NPU + "import torch\nimport model\nmodel = model.RNNModel(10, 20)\nmodel = model.npu()\n",
     set()),
    ("module-name-rebound-later-is-still-the-module-before",
     "import torch\nimport model\nx = model.cuda()\nmodel = model.Net()\n",
     "import torch\nimport model\nx = model.cuda()\nmodel = model.Net()\n",
     {"cuda-leftover"}),
    ("module-name-rebound-used-in-a-function-shaped-like-the-method",
     "import torch\nimport model\nmodel = model.Net()\ndef go():\n    return model.cuda(non_blocking=True)\n",
     NPU + "import torch\nimport model\nmodel = model.Net()\ndef go():\n    return model.npu(non_blocking=True)\n",
     set()),
    ("module-name-rebound-odd-call-is-flagged-not-guessed",
     "import torch\nimport model\nmodel = model.Net()\ndef go():\n    return model.cuda(1, 2, 3)\n",
     "import torch\nimport model\nmodel = model.Net()\ndef go():\n    return model.cuda(1, 2, 3)\n",
     {"ambiguous-cuda"}),
    ("pure-module-cuda-function-is-reported",
     "import torch\nimport helpers\nhelpers.cuda()\n",
     "import torch\nimport helpers\nhelpers.cuda()\n",
     {"cuda-leftover"}),
    # 2. torch.load: "cpu" only when the result provably goes into load_state_dict
    ("torch-load-of-whole-objects-goes-to-the-npu",
     "import torch\nmodel, criterion, optimizer = torch.load(f)\nself.best = torch.load(p)\nitems = [torch.load(p) for p in ps]\n",
     NPU + 'import torch\nmodel, criterion, optimizer = torch.load(f, map_location="npu")\n'
     'self.best = torch.load(p, map_location="npu")\nitems = [torch.load(p, map_location="npu") for p in ps]\n',
     {"torch-load"}),
    ("torch-load-into-load-state-dict-goes-to-the-cpu",
     'import torch\nnet.load_state_dict(torch.load(p))\nsd = torch.load(p)\nnet.load_state_dict(sd)\n'
     'opt.load_state_dict(torch.load(q)["optimizer"])\n',
     'import torch\nnet.load_state_dict(torch.load(p, map_location="cpu"))\nsd = torch.load(p, map_location="cpu")\n'
     'net.load_state_dict(sd)\nopt.load_state_dict(torch.load(q, map_location="cpu")["optimizer"])\n',
     {"torch-load"}),
    ("torch-load-checkpoint-also-read-otherwise-goes-to-the-npu",
     'import torch\nckpt = torch.load(p)\nnet.load_state_dict(ckpt["model"])\nbest = ckpt["best_acc"]\n',
     NPU + 'import torch\nckpt = torch.load(p, map_location="npu")\nnet.load_state_dict(ckpt["model"])\nbest = ckpt["best_acc"]\n',
     {"torch-load"}),
    # 4. torch APIs whose device defaults to CUDA
    ("grad-scaler-without-device",
     "import torch\nfrom torch.amp import GradScaler\ns1 = torch.amp.GradScaler()\ns2 = GradScaler(enabled=True)\n"
     "s3 = torch.amp.GradScaler('cuda')\n",
     NPU + "import torch\nfrom torch.amp import GradScaler\ns1 = torch.amp.GradScaler(\"npu\")\n"
     "s2 = GradScaler(\"npu\", enabled=True)\ns3 = torch.amp.GradScaler('npu')\n",
     set()),
    ("sharded-grad-scaler-and-autocast-state",
     "import torch\nfrom torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\ns = ShardedGradScaler()\n"
     "torch.set_autocast_enabled(True)\nprint(torch.is_autocast_enabled())\n",
     NPU + "import torch\nfrom torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
     "s = ShardedGradScaler(\"npu\")\ntorch.set_autocast_enabled(\"npu\", True)\nprint(torch.is_autocast_enabled(\"npu\"))\n",
     set()),
    # 7. device strings for CUDA-only libraries are theirs
    ("isaac-gym-sim-device-kept-torch-device-rewritten",
     'import torch\nfrom isaacgym import gymapi\nargs.sim_device = "cuda:0"\n'
     'env = make_env(sim_device="cuda:0", rl_device="cuda:0")\n'
     'params = [{"name": "--sim_device", "type": str, "default": "cuda:0"}]\n',
     NPU + 'import torch\nfrom isaacgym import gymapi\nargs.sim_device = "cuda:0"\n'
     'env = make_env(sim_device="cuda:0", rl_device="npu:0")\n'
     'params = [{"name": "--sim_device", "type": str, "default": "cuda:0"}]\n',
     {"cuda-only-library", "cuda-only-device"}),
    ("isaac-gym-device-type-comparisons-kept",
     'import torch\nfrom isaacgym import gymutil\nsim_device_type, sim_device_id = gymutil.parse_device_str(d)\n'
     'if sim_device_type == "cuda" and pipeline:\n    pass\nif args.sim_device == "cuda":\n    pass\n'
     'if args.rl_device == "cuda":\n    pass\n',
     NPU + 'import torch\nfrom isaacgym import gymutil\nsim_device_type, sim_device_id = gymutil.parse_device_str(d)\n'
     'if sim_device_type == "cuda" and pipeline:\n    pass\nif args.sim_device == "cuda":\n    pass\n'
     'if args.rl_device == "npu":\n    pass\n',
     {"cuda-only-library", "cuda-only-device"}),
    ("warp-device-kept",
     'import torch\nimport warp as wp\na = wp.zeros(10, device="cuda:0")\nb = torch.zeros(10, device="cuda:0")\n',
     NPU + 'import torch\nimport warp as wp\na = wp.zeros(10, device="cuda:0")\nb = torch.zeros(10, device="npu:0")\n',
     {"cuda-only-library", "cuda-only-device"}),
    # 8. a type check is not a use of an unsupported API
    ("isinstance-of-an-unsupported-class-is-not-a-use",
     "import torch\nif issubclass(type(m), torch.nn.RNNBase) or isinstance(m, (torch.nn.GRU, int)):\n    pass\n"
     "def f(m: torch.nn.GRU) -> torch.nn.GRU:\n    return m\n",
     "import torch\nif issubclass(type(m), torch.nn.RNNBase) or isinstance(m, (torch.nn.GRU, int)):\n    pass\n"
     "def f(m: torch.nn.GRU) -> torch.nn.GRU:\n    return m\n",
     set()),
    ("constructing-an-unsupported-class-is-reported",
     "import torch\nrnn = torch.nn.GRU(4, 4)\n",
     "import torch\nrnn = torch.nn.GRU(4, 4)\n",
     {"unsupported-api"}),
    # 9. allocator env vars, generic spelling included; CUDA-only options reported
    ("allocator-env-vars",
     'import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"\n'
     'os.environ["PYTORCH_ALLOC_CONF"] = "backend:cudaMallocAsync"\n',
     'import os\nos.environ["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"\n'
     'os.environ["PYTORCH_NPU_ALLOC_CONF"] = "backend:cudaMallocAsync"\n',
     {"env-var"}),
    # 10. a condition is migrated whole or kept whole, never half
    ("capability-condition-kept-whole",
     "import torch\nif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:\n"
     "    dtype = torch.float32\nelse:\n    dtype = torch.bfloat16\n",
     "import torch\nif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:\n"
     "    dtype = torch.float32\nelse:\n    dtype = torch.bfloat16\n",
     {"mixed-condition", "device-capability"}),
    ("capability-condition-in-a-decorator-and-an-assignment",
     "import torch, pytest\nok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8\n"
     "@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0), reason='x')\n"
     "def test():\n    torch.cuda.synchronize()\n",
     NPU + "import torch, pytest\nok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8\n"
     "@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0), reason='x')\n"
     "def test():\n    torch.npu.synchronize()\n",
     {"mixed-condition", "device-capability"}),
    ("availability-only-condition-is-migrated",
     "import torch\nif torch.cuda.is_available() and torch.cuda.device_count() > 1:\n    pass\n",
     NPU + "import torch\nif torch.npu.is_available() and torch.npu.device_count() > 1:\n    pass\n",
     set()),
    # the audit: what no rule handles is reported, text is not
    ("leftovers-are-reported-text-is-not",
     'import torch\nimport logging\nlogging.info("moving to cuda:0")\nparser.add_argument("--x", help="cuda")\n'
     'key = "cuda"\nflag = args.cuda\nnames = {"cuda": 1}\n',
     'import torch\nimport logging\nlogging.info("moving to cuda:0")\nparser.add_argument("--x", help="cuda")\n'
     'key = "cuda"\nflag = args.cuda\nnames = {"cuda": 1}\n',
     {"device-string", "cuda-leftover"}),
    # 11. (pyro, mamba, peft) a class's own is_cuda flag or property is not Tensor.is_cuda
    ("own-is-cuda-attribute-and-property-are-kept",
     "import torch\nclass Model(torch.nn.Module):\n    def __init__(self, cuda):\n        super().__init__()\n"
     "        self.is_cuda = cuda\n    def place(self, x):\n        return x.to('cuda') if self.is_cuda else x\n"
     "class Loader:\n    @property\n    def is_cuda(self):\n        return False\n"
     "m = Model(False)\nprint(m.is_cuda, Loader().is_cuda, torch.zeros(1).is_cuda)\n",
     NPU + "import torch\nclass Model(torch.nn.Module):\n    def __init__(self, cuda):\n        super().__init__()\n"
     "        self.is_cuda = cuda\n    def place(self, x):\n        return x.to('npu') if self.is_cuda else x\n"
     "class Loader:\n    @property\n    def is_cuda(self):\n        return False\n"
     "m = Model(False)\nprint(m.is_cuda, Loader().is_cuda, torch.zeros(1).is_npu)\n",
     {"user-cuda-attribute"}),
    # a decorator passed around as a value cannot be given device_type: torch_npu's amp module has it
    ("amp-decorator-used-as-a-value-keeps-cuda-amp-semantics",
     "import torch\nfrom torch.cuda.amp import custom_fwd\nmy_fwd = wrap(custom_fwd)\n",
     NPU + "import torch\nfrom torch_npu.npu.amp import custom_fwd\nmy_fwd = wrap(custom_fwd)\n",
     set()),
    ("amp-decorator-applied-is-upgraded",
     "import torch\nfrom torch.cuda.amp import custom_fwd\n@custom_fwd\ndef f(x):\n    return x\n",
     NPU + "import torch\nfrom torch.amp import custom_fwd\n@custom_fwd(device_type=\"npu\")\ndef f(x):\n    return x\n",
     set()),
    # an item assignment names a device like a dict key does
    ("item-assigned-device-type",
     "import torch\ndef deco(*args, **kwargs):\n    kwargs[\"device_type\"] = \"cuda\"\n    opts['backend'] = 'nccl'\n",
     NPU + "import torch\ndef deco(*args, **kwargs):\n    kwargs[\"device_type\"] = \"npu\"\n    opts['backend'] = 'hccl'\n",
     set()),
    # a torch CUDA name in a string (a mock.patch target) is reported, not left silently
    ("mock-patch-target-naming-torch-cuda-is-reported",
     "import torch\nfrom unittest.mock import patch\nwith patch(\"torch.cuda.empty_cache\") as m:\n    pass\n",
     "import torch\nfrom unittest.mock import patch\nwith patch(\"torch.cuda.empty_cache\") as m:\n    pass\n",
     {"cuda-leftover"}),
    # torch.save then torch.load of the same file: a round trip keeps each tensor's device
    ("torch-load-of-what-the-code-saved-is-left",
     "import io, torch\nbuf = io.BytesIO()\ntorch.save(net, buf)\nnet2 = torch.load(buf, weights_only=False)\n"
     "torch.save(state, 'tmp.pt')\nstate = torch.load('tmp.pt')\nother = torch.load('other.pt')\n",
     NPU + "import io, torch\nbuf = io.BytesIO()\ntorch.save(net, buf)\nnet2 = torch.load(buf, weights_only=False)\n"
     "torch.save(state, 'tmp.pt')\nstate = torch.load('tmp.pt', weights_only=False)\n"
     "other = torch.load('other.pt', map_location=\"npu\")\n",
     {"torch-load", "torch-load-weights-only"}),
    # torch >= 2.6 loads weights_only=True: the code's own whole-object file gets weights_only=False, a
    # state dict needs nothing, a file from elsewhere is reported
    ("torch-load-weights-only-by-whose-file-it-is",
     "import torch\ntorch.save(model, 'model.pt')\nmodel = torch.load('model.pt')\n"
     "torch.save(model.state_dict(), 'w.pt')\nmodel.load_state_dict(torch.load('w.pt'))\n"
     "opt = torch.load('downloaded.pt')\n",
     NPU + "import torch\ntorch.save(model, 'model.pt')\nmodel = torch.load('model.pt', weights_only=False)\n"
     "torch.save(model.state_dict(), 'w.pt')\nmodel.load_state_dict(torch.load('w.pt'))\n"
     "opt = torch.load('downloaded.pt', map_location=\"npu\")\n",
     {"torch-load", "torch-load-weights-only"}),
    # transformers routes flash_attention_2 to torch_npu's fused attention on an NPU; a file that imports
    # flash_attn itself has its own path into flash_attn's CUDA kernels
    ("flash-attention-2-kept-where-transformers-routes-it",
     "from transformers import AutoModel\nm = AutoModel.from_pretrained('x', attn_implementation=\"flash_attention_2\")\n",
     "from transformers import AutoModel\nm = AutoModel.from_pretrained('x', attn_implementation=\"flash_attention_2\")\n",
     {"flash-attention-2"}),
    ("flash-attention-2-in-a-file-importing-flash-attn-is-reported",
     "import flash_attn\nfrom transformers import AutoModel\n"
     "m = AutoModel.from_pretrained('x', attn_implementation=\"flash_attention_2\")\n",
     "import flash_attn\nfrom transformers import AutoModel\n"
     "m = AutoModel.from_pretrained('x', attn_implementation=\"flash_attention_2\")\n",
     {"flash-attn", "flash-attention-2"}),
    # NVIDIA's tools run from Python: a command string or a list's first word
    ("nvidia-tools-run-from-python-are-reported",
     "import os, subprocess\nsubprocess.run(['nvcc', '-O3', 'k.cu'])\nos.system('nsys profile python t.py')\n"
     "subprocess.check_output('ncu --set full python t.py', shell=True)\nprint('nvcc not found')\n",
     "import os, subprocess\nsubprocess.run(['nvcc', '-O3', 'k.cu'])\nos.system('nsys profile python t.py')\n"
     "subprocess.check_output('ncu --set full python t.py', shell=True)\nprint('nvcc not found')\n",
     {"nvcc", "nvidia-profiler"}),
    # a job script the code writes from a template asks for GPUs
    ("job-script-template-in-python-is-reported",
     "import torch\nTEMPLATE = '#SBATCH --nodes={nodes}\\n#SBATCH --gres=gpu:{ngpus}\\nsrun python t.py\\n'\n"
     "def script(n):\n    return f'#SBATCH --gpus-per-node={n}\\n'\n",
     "import torch\nTEMPLATE = '#SBATCH --nodes={nodes}\\n#SBATCH --gres=gpu:{ngpus}\\nsrun python t.py\\n'\n"
     "def script(n):\n    return f'#SBATCH --gpus-per-node={n}\\n'\n",
     {"job-gpu-request"}),
    # a rewritten availability check must not let a CUDA call it guards run on the NPU host
    ("guard-of-a-capability-call-kept-whole",
     "import torch\nif torch.cuda.is_available():\n    cap = torch.cuda.get_device_capability()\n"
     "    use_bf16 = cap[0] >= 8\nelse:\n    use_bf16 = False\nx = torch.zeros(1).cuda()\n",
     NPU + "import torch\nif torch.cuda.is_available():\n    cap = torch.cuda.get_device_capability()\n"
     "    use_bf16 = cap[0] >= 8\nelse:\n    use_bf16 = False\nx = torch.zeros(1).npu()\n",
     {"mixed-guard", "device-capability"}),
    ("conditional-expression-guarding-a-capability-call-kept-whole",
     "import torch\ncap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)\n",
     "import torch\ncap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)\n",
     {"mixed-guard", "device-capability"}),
    ("guard-of-migratable-code-is-migrated",
     "import torch\nif torch.cuda.is_available():\n    model = model.cuda()\n    torch.cuda.synchronize()\n",
     NPU + "import torch\nif torch.npu.is_available():\n    model = model.npu()\n    torch.npu.synchronize()\n",
     set()),
    # the same path expression over the same instance's attributes: a round trip across two methods
    ("torch-load-of-a-path-expression-the-code-saved-is-left",
     "import os, torch\nclass Data:\n    def download(self):\n        torch.save(x, os.path.join(self.root, self.f))\n"
     "    def __getitem__(self, i):\n        return torch.load(os.path.join(self.root,  self.f)).numpy()\n",
     "import os, torch\nclass Data:\n    def download(self):\n        torch.save(x, os.path.join(self.root, self.f))\n"
     "    def __getitem__(self, i):\n        return torch.load(os.path.join(self.root,  self.f), weights_only=False).numpy()\n",
     {"torch-load"}),
    # equal text over different local variables is not the same file
    ("torch-load-of-an-equal-expression-over-other-variables-gets-a-location",
     "import os, torch\ndef save(d):\n    torch.save(x, os.path.join(d, 'a.pt'))\n"
     "def load(d):\n    return torch.load(os.path.join(d, 'a.pt'))\n",
     NPU + "import os, torch\ndef save(d):\n    torch.save(x, os.path.join(d, 'a.pt'))\n"
     "def load(d):\n    return torch.load(os.path.join(d, 'a.pt'), map_location=\"npu\")\n",
     {"torch-load"}),
]


@pytest.mark.parametrize("source, expected, kinds", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_real_code_class(source, expected, kinds):
    outcome = migrate_python(source, "t.py")
    assert outcome.text == expected
    found = {f.kind for f in outcome.findings}
    assert kinds <= found, f"missing findings {kinds - found}; got {sorted(found)}"
    unexpected = found & {"cuda-leftover", "mixed-condition", "ambiguous-cuda", "unsupported-api"} - kinds
    assert not unexpected, [f for f in outcome.findings if f.kind in unexpected]


def test_flash_attention_2_is_judged_by_whether_the_file_calls_flash_attn_itself():
    routed, own = (next(c[1] for c in CASES if c[0] == name) for name in (
        "flash-attention-2-kept-where-transformers-routes-it",
        "flash-attention-2-in-a-file-importing-flash-attn-is-reported"))
    (kept,) = [f for f in migrate_python(routed, "t.py").findings if f.kind == "flash-attention-2"]
    assert kept.severity == "info" and "npu_fusion_attention" in kept.reason
    (reported,) = [f for f in migrate_python(own, "t.py").findings if f.kind == "flash-attention-2"]
    assert reported.severity == "error" and reported.line == 3


def test_nvidia_tools_from_python_are_reported_where_run_not_where_printed():
    source = next(c[1] for c in CASES if c[0] == "nvidia-tools-run-from-python-are-reported")
    found = [(f.line, f.kind) for f in migrate_python(source, "t.py").findings
             if f.kind in ("nvcc", "nvidia-profiler")]
    assert found == [(2, "nvcc"), (3, "nvidia-profiler"), (4, "nvidia-profiler")]


def test_leftover_points_at_the_line_and_names_the_use():
    outcome = migrate_python("import torch\nimport helpers\n\nhelpers.cuda()\n", "t.py")
    (leftover,) = [f for f in outcome.findings if f.kind == "cuda-leftover"]
    assert (leftover.line, leftover.col) == (4, 1)
    assert "`helpers.cuda()`" in leftover.reason and leftover.severity == "warning"


def test_mixed_condition_finding_says_which_branch_the_npu_host_takes():
    source = CASES[[c[0] for c in CASES].index("capability-condition-kept-whole")][1]
    (finding,) = [f for f in migrate_python(source, "t.py").findings if f.kind == "mixed-condition"]
    assert finding.severity == "error" and finding.line == 2
    assert "no-CUDA branch" in finding.reason


def test_cuda_default_tensor_type_reports_every_legacy_constructor_in_the_tree(tmp_path):
    """llama-style: generation code makes torch.cuda.HalfTensor the default; model-parallel layers in
    another file build weights with torch.Tensor(out, in): on the NPU those would be CPU tensors."""
    from npukit.migrate import MigrateOptions, run_migration

    (tmp_path / "generate.py").write_text(
        "import torch\nfrom layers import Linear\ntorch.set_default_tensor_type(torch.cuda.HalfTensor)\n"
        "model = Linear(4, 4)\n")
    (tmp_path / "layers.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Linear(nn.Module):\n    def __init__(self, i, o):\n"
        "        super().__init__()\n        self.weight = nn.Parameter(torch.Tensor(o, i))\n"
        "        self.bias = nn.Parameter(torch.empty(o))\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True, quiet=True))
    found = {(f.path, f.line, f.kind) for f in run.findings}
    assert ("layers.py", 7, "legacy-constructor") in found
    assert ("generate.py", 3, "legacy-constructor") in found
    assert not any(f.path == "layers.py" and f.line == 8 for f in run.findings)  # torch.empty follows the default
    (changed,) = [r for r in run.changed]
    assert changed.path == "generate.py"


def test_legacy_constructors_are_not_reported_without_a_cuda_default_tensor_type(tmp_path):
    from npukit.migrate import MigrateOptions, run_migration

    (tmp_path / "layers.py").write_text("import torch\nw = torch.Tensor(3, 4).cuda()\n")
    run = run_migration(MigrateOptions(target=tmp_path, dry_run=True, quiet=True))
    assert "legacy-constructor" not in {f.kind for f in run.findings}


def test_the_trees_own_package_is_not_a_cuda_only_library(tmp_path):
    """mamba's repository imports its own mamba_ssm package (dataclasses, utilities): those imports
    are not third-party CUDA code; an import of a CUDA-only library it does not contain still is."""
    from npukit.migrate.runner import MigrateOptions, run_migration

    (tmp_path / "mamba_ssm" / "models").mkdir(parents=True)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("")
    (tmp_path / "mamba_ssm" / "models" / "__init__.py").write_text("")
    (tmp_path / "mamba_ssm" / "models" / "config.py").write_text("from dataclasses import dataclass\n")
    (tmp_path / "train.py").write_text("import torch\nfrom mamba_ssm.models.config import Config\n"
                                       "from causal_conv1d import causal_conv1d_fn\nx = torch.zeros(2).cuda()\n")
    run = run_migration(MigrateOptions(tmp_path, dry_run=True, jobs=1, quiet=True))
    kinds = sorted((f.path, f.line, f.kind) for result in run.results for f in result.findings)
    assert kinds == [("train.py", 3, "cuda-only-library")]


def test_ddp_in_a_file_whose_imported_helper_sets_the_device_names_the_helper(tmp_path):
    """facebookresearch/mae: main_*.py build DDP after misc.init_distributed_mode(args), which calls
    set_device in util/misc.py; the finding said only "this file never calls set_device"."""
    from npukit.migrate.runner import MigrateOptions, run_migration

    (tmp_path / "util").mkdir()
    (tmp_path / "util" / "__init__.py").write_text("")
    (tmp_path / "util" / "misc.py").write_text("import torch\n\ndef init(args):\n    torch.cuda.set_device(args.gpu)\n")
    (tmp_path / "main.py").write_text("import torch\nimport util.misc as misc\nmisc.init(args)\n"
                                      "m = torch.nn.parallel.DistributedDataParallel(model.cuda())\n")
    (tmp_path / "other.py").write_text("import torch\nm = torch.nn.parallel.DistributedDataParallel(model.cuda())\n")
    run = run_migration(MigrateOptions(tmp_path, dry_run=True, jobs=1, quiet=True))
    reasons = {f.path: f.reason for result in run.results for f in result.findings if f.kind == "ddp-set-device"}
    assert reasons["main.py"].endswith("(the tree's util/misc.py, which it imports, does: make sure that runs first)")
    assert reasons["other.py"].endswith("this file never calls set_device")


def test_a_notebook_shell_line_continued_with_a_backslash(tmp_path):
    import json

    from npukit.migrate.textfiles import migrate_notebook

    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
             for source in (["!python prep.py --a 1 \\\n", "    --b 2\n", "%time x = 1"],
                            ["import torch\n", "x = torch.zeros(2).cuda()\n"])]
    text, _, findings = migrate_notebook(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                     "nbformat_minor": 5}), "nb.ipynb")
    migrated = [cell["source"] for cell in json.loads(text)["cells"]]
    assert migrated[0][-3:] == ["!python prep.py --a 1 \\\n", "    --b 2\n", "%time x = 1"]  # shell lines untouched
    assert migrated[1] == ["import torch\n", "x = torch.zeros(2).npu()\n"]
    assert not [f for f in findings if f.kind == "unparsable"]


def test_a_job_script_template_is_reported_in_a_string_and_an_f_string():
    source = next(c[1] for c in CASES if c[0] == "job-script-template-in-python-is-reported")
    found = [(f.line, f.kind) for f in migrate_python(source, "t.py").findings if f.kind == "job-gpu-request"]
    assert found == [(2, "job-gpu-request"), (4, "job-gpu-request")]
