// npukit emulated NPU: a real PrivateUse1 device ("npu") whose memory is host memory.
//
// Every op without an explicit kernel goes through one boxed fallback: npu tensor
// arguments are replaced by CPU tensors aliasing the same memory (no copy), the op's CPU
// kernel runs, and outputs are turned back into npu tensors (views keep their base's
// storage; fresh results are adopted zero-copy). Numeric policies of the Ascend device
// (fp16 saturation, fp32 accumulation, HF32, no float64 on the cube unit) apply here.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/SDPBackend.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/_scaled_dot_product_attention_math_native.h>
#include <ATen/Operators.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <array>
#include <deque>
#include <map>
#include <atomic>
#include <chrono>
#include <cstring>
#include <typeinfo>
#include <mutex>
#include <thread>
#include <optional>
#include <unordered_set>

namespace npukit {

using c10::DeviceType;
constexpr DeviceType kNpu = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ------------------------------------------------------------------ device selection
std::atomic<int> g_device_count{8};
thread_local c10::DeviceIndex t_current_device = 0;

void check_index(int idx) {
  TORCH_CHECK(idx >= 0 && idx < g_device_count.load(), "Invalid device id: npu:", idx,
              " (this process sees ", g_device_count.load(),
              " NPUs; set NPUKIT_DEVICE_COUNT or ASCEND_RT_VISIBLE_DEVICES to change that)");
}

// ------------------------------------------------------------------ memory accounting
// Every op result is accounted (and freed) under this lock: a few stores, held for nanoseconds, so a
// spin lock, not a std::mutex (whose lock and unlock calls were 7% of the npu overhead of a
// backward pass). Nothing blocks while holding it (memory_stats copies the counters out first).
struct SpinLock {
  std::atomic<bool> locked{false};
  void lock() {
    while (locked.exchange(true, std::memory_order_acquire))
      while (locked.load(std::memory_order_relaxed)) std::this_thread::yield();
  }
  void unlock() { locked.store(false, std::memory_order_release); }
};

struct DeviceMemory {
  SpinLock mu;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t blocks = 0;
  int64_t peak_blocks = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_ooms = 0;
  int64_t capacity = int64_t(64) << 30;
};
std::array<DeviceMemory, kMaxDevices> g_memory;

std::string format_bytes(double b) {
  char buf[64];
  if (b >= double(1 << 30)) snprintf(buf, sizeof buf, "%.2f GiB", b / double(1 << 30));
  else if (b >= double(1 << 20)) snprintf(buf, sizeof buf, "%.2f MiB", b / double(1 << 20));
  else if (b >= 1024) snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  else snprintf(buf, sizeof buf, "%.0f bytes", b);
  return buf;
}

void account_alloc(int dev, int64_t nbytes) {
  auto& m = g_memory[dev];
  std::lock_guard<SpinLock> lock(m.mu);
  if (m.allocated + nbytes > m.capacity) {
    m.num_ooms++;
    int64_t free_bytes = m.capacity - m.allocated;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "NPU out of memory. Tried to allocate ",
                     format_bytes(nbytes), " (NPU ", dev, "; ", format_bytes(m.capacity),
                     " total capacity; ", format_bytes(m.allocated), " already allocated; ",
                     format_bytes(free_bytes), " free; ", format_bytes(m.allocated),
                     " reserved in total by PyTorch) [npukit emulated device]");
  }
  m.allocated += nbytes;
  m.blocks += 1;
  m.num_allocs += 1;
  if (m.allocated > m.peak) m.peak = m.allocated;
  if (m.blocks > m.peak_blocks) m.peak_blocks = m.blocks;
}

void account_free(int dev, int64_t nbytes) {
  auto& m = g_memory[dev];
  std::lock_guard<SpinLock> lock(m.mu);
  m.allocated -= nbytes;
  m.blocks -= 1;
  m.num_frees += 1;
}

// ------------------------------------------------------------------ allocators
// What every npu DataPtr's context is: the accounting of its memory, and the CPU storage that
// aliases it for the CPU kernels (made on first use, then shared by every call: creating one per
// argument per call was a third of the per-op cost of small ops).
struct NpuBlock {
  int64_t nbytes;
  int device;
  std::atomic<c10::StorageImpl*> cpu_alias{nullptr};  // one reference, owned by the block
  NpuBlock(int64_t nbytes, int device) : nbytes(nbytes), device(device) {}
  virtual ~NpuBlock() {
    if (auto* alias = cpu_alias.load()) c10::intrusive_ptr<c10::StorageImpl>::reclaim(alias);
  }
};

struct OwnedBlock final : NpuBlock {
  void* ptr;
  OwnedBlock(void* ptr, int64_t nbytes, int device) : NpuBlock(nbytes, device), ptr(ptr) {}
};

void free_owned_block(void* ctx) {
  auto* block = static_cast<OwnedBlock*>(ctx);
  c10::free_cpu(block->ptr);
  account_free(block->device, block->nbytes);
  delete block;
}

struct NpuAllocator final : c10::Allocator {
  int fixed_device = -1;  // -1: the thread's current device
  c10::DataPtr allocate(size_t nbytes) override {
    int dev = fixed_device >= 0 ? fixed_device : t_current_device;
    account_alloc(dev, int64_t(nbytes));
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    auto* block = new OwnedBlock(ptr, int64_t(nbytes), dev);
    return {ptr, block, &free_owned_block, c10::Device(kNpu, c10::DeviceIndex(dev))};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    std::memcpy(dest, src, count);
  }
};

NpuAllocator g_current_allocator;
std::array<NpuAllocator, kMaxDevices> g_device_allocators;

NpuAllocator* allocator_for(int dev) { return &g_device_allocators[dev]; }

// Pinned host memory: plain host memory whose pointers are remembered, as pin_memory() expects.
std::mutex g_pinned_mu;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    g_pinned.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned.insert(ptr);
    }
    return {ptr, ptr, &free_pinned, c10::Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    std::memcpy(dest, src, count);
  }
};
PinnedAllocator g_pinned_allocator;

// An npu storage adopting the memory of a CPU storage produced by a CPU kernel (no copy).
struct AdoptedBlock final : NpuBlock {
  c10::intrusive_ptr<c10::StorageImpl> cpu;
  AdoptedBlock(c10::intrusive_ptr<c10::StorageImpl> cpu, int64_t nbytes, int device)
      : NpuBlock(nbytes, device), cpu(std::move(cpu)) {}
};

void free_adopted_block(void* ctx) {
  auto* block = static_cast<AdoptedBlock*>(ctx);
  account_free(block->device, block->nbytes);
  delete block;
}

c10::Storage adopt_cpu_storage(c10::StorageImpl* cpu, int dev) {
  int64_t nbytes = int64_t(cpu->nbytes());
  account_alloc(dev, nbytes);
  auto* block = new AdoptedBlock(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(cpu), nbytes, dev);
  c10::DataPtr data(cpu->mutable_data(), block, &free_adopted_block,
                    c10::Device(kNpu, c10::DeviceIndex(dev)));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), size_t(nbytes), std::move(data), allocator_for(dev),
      /*resizable=*/true));
}

// A fresh CPU result nothing else refers to becomes an npu tensor in place: its storage's memory
// is handed to an npu DataPtr (which keeps the CPU one to free it), its TensorImpl moves to the npu
// keys. No new storage or tensor object, as a device kernel writing its own output would have.
struct HandedOverBlock final : NpuBlock {
  c10::DataPtr cpu_memory;
  HandedOverBlock(int64_t nbytes, int device) : NpuBlock(nbytes, device) {}
};

// A block is made and freed per op result: freed blocks wait on a per-thread list for the next
// result rather than going back to malloc. t_handed_over_pool_gone: the list was destroyed at
// thread exit (a trivially destructible flag, readable after that), blocks freed later are deleted.
struct HandedOverPool {
  static constexpr size_t kMaxIdle = 256;
  std::vector<HandedOverBlock*> idle;
  HandedOverPool() { idle.reserve(kMaxIdle); }  // no allocation when a block is given back
  ~HandedOverPool();
};
thread_local bool t_handed_over_pool_gone = false;
thread_local HandedOverPool t_handed_over_pool;
HandedOverPool::~HandedOverPool() {
  t_handed_over_pool_gone = true;
  for (HandedOverBlock* block : idle) delete block;
}

HandedOverBlock* new_handed_over_block(int64_t nbytes, int device) {
  if (!t_handed_over_pool_gone) {
    auto& idle = t_handed_over_pool.idle;
    if (!idle.empty()) {
      HandedOverBlock* block = idle.back();
      idle.pop_back();
      block->nbytes = nbytes;
      block->device = device;
      return block;
    }
  }
  return new HandedOverBlock(nbytes, device);
}

void free_handed_over_block(void* ctx) {
  auto* block = static_cast<HandedOverBlock*>(ctx);
  account_free(block->device, block->nbytes);
  if (!t_handed_over_pool_gone && t_handed_over_pool.idle.size() < HandedOverPool::kMaxIdle) {
    block->cpu_memory.clear();  // frees the memory
    if (auto* alias = block->cpu_alias.exchange(nullptr, std::memory_order_acq_rel))
      c10::intrusive_ptr<c10::StorageImpl>::reclaim(alias);  // as ~NpuBlock does
    t_handed_over_pool.idle.push_back(block);
    return;
  }
  delete block;  // frees the memory through the CPU DataPtr it keeps
}

bool can_hand_over(const at::Tensor& cpu) {
  const c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
  return cpu.use_count() == 1 && cpu.weak_use_count() == 1 && cpu.storage().use_count() == 1 &&
         typeid(*impl) == typeid(c10::TensorImpl) && !cpu._is_zerotensor() && cpu.storage().data_ptr().get();
}

at::Tensor hand_over_to_npu(const at::Tensor& cpu, int dev) {
  c10::StorageImpl* storage = cpu.storage().unsafeGetStorageImpl();
  int64_t nbytes = int64_t(storage->nbytes());
  account_alloc(dev, nbytes);
  c10::Device npu(kNpu, c10::DeviceIndex(dev));
  auto* block = new_handed_over_block(nbytes, dev);
  block->cpu_memory = storage->set_data_ptr(c10::DataPtr(storage->mutable_data(), block, &free_handed_over_block, npu));
  storage->set_allocator(allocator_for(dev));
  c10::TensorImpl* impl = cpu.unsafeGetTensorImpl();
  impl->_change_backend_component_keys(npu);
  impl->set_storage_keep_dtype(cpu.storage());  // the device follows the storage's
  return cpu;
}

// A CPU storage over an npu storage's memory, not owning it: what CPU kernels read and write.
c10::intrusive_ptr<c10::StorageImpl> make_cpu_view(const c10::Storage& npu) {
  c10::DataPtr view(npu.mutable_data(), c10::Device(DeviceType::CPU));  // non-owning
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), npu.nbytes(),
                                               std::move(view), c10::GetCPUAllocator(), /*resizable=*/true);
}

// The CPU storage aliasing an npu storage's memory, shared by all calls; none when the npu storage
// is not one of ours or a kernel re-pointed the alias (out= resized). Not a new reference: the
// npu storage's block owns it, so it lives as long as the npu storage.
c10::StorageImpl* shared_cpu_alias(const c10::Storage& npu) {
  const c10::DataPtr& data = npu.data_ptr();
  auto deleter = data.get_deleter();
  if (deleter != &free_owned_block && deleter != &free_adopted_block && deleter != &free_handed_over_block)
    return nullptr;
  auto* block = static_cast<NpuBlock*>(data.get_context());
  c10::StorageImpl* alias = block->cpu_alias.load(std::memory_order_acquire);
  if (!alias) {
    c10::StorageImpl* made = make_cpu_view(npu).release();
    if (block->cpu_alias.compare_exchange_strong(alias, made, std::memory_order_acq_rel)) alias = made;
    else c10::intrusive_ptr<c10::StorageImpl>::reclaim(made);  // another thread made it first
  }
  if (alias->data() != npu.data() || alias->nbytes() != npu.nbytes()) return nullptr;
  return alias;
}

// The shared alias, or one for this use alone where there is none.
c10::Storage cpu_storage_for(const c10::Storage& npu) {
  c10::StorageImpl* shared = shared_cpu_alias(npu);
  return c10::Storage(shared ? c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(shared) : make_cpu_view(npu));
}

// ------------------------------------------------------------------ numeric policies
std::atomic<bool> g_saturation{false};      // fp16 results clamp to +-65504 (910A-style)
std::atomic<bool> g_overflow_flag{false};   // sticky, like the float-status register
std::atomic<bool> g_fp32_accumulate{true};  // fp16/bf16 matmul/conv computed in fp32
std::atomic<bool> g_matmul_hf32{false};     // torch_npu default: matmul.allow_hf32 = False
std::atomic<bool> g_conv_hf32{true};        // torch_npu default: conv.allow_hf32 = True
std::atomic<bool> g_reject_fp64{true};      // float64 matmul/conv raise, as on the device
std::atomic<bool> g_check_devices{true};    // npu/cpu tensor mixing raises, as on CUDA/NPU

constexpr double kHalfMax = 65504.0;

// Saturation mode: results outside fp16 range become +-65504 (NaN becomes 0) and the
// sticky overflow flag is set, as the AI core does with saturation on.
void saturate_half(const at::Tensor& cpu) {
  if (!g_saturation.load(std::memory_order_relaxed) || cpu.scalar_type() != at::kHalf ||
      cpu.numel() == 0)
    return;
  if (at::isfinite(cpu).all().item<bool>()) return;
  g_overflow_flag = true;
  cpu.nan_to_num_(0.0, kHalfMax, -kHalfMax);
}

// HF32 keeps 10 explicit mantissa bits (like TF32), rounded to nearest even; inf/nan kept.
// Written branch-free on the bits so the compiler vectorises it: this runs on every fp32 conv
// input when HF32 is on.
static void round_hf32_bits(const uint32_t* __restrict__ in, uint32_t* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x = in[i];
    uint32_t rounded = (x + 0x0FFFu + ((x >> 13) & 1u)) & 0xFFFFE000u;
    uint32_t special = 0u - uint32_t((x & 0x7F800000u) == 0x7F800000u);  // all ones for inf/nan
    out[i] = (x & special) | (rounded & ~special);
  }
}

// The HF32 copies of a training step come in the same sizes every step, and a fresh large host
// allocation costs a page fault per 4 KiB (measured: 1,600 per step of the CNN benchmark, about
// as long as the rounding itself). Their memory is kept for reuse, up to kMaxIdleBytes.
struct Hf32CopyAllocator final : c10::Allocator {
  struct Block {
    void* ptr;
    size_t nbytes;
  };
  static constexpr size_t kMaxIdleBytes = size_t(512) << 20;
  std::mutex mu;
  std::multimap<size_t, void*> idle;
  size_t idle_bytes = 0;

  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = idle.find(nbytes);
      if (it != idle.end()) {
        ptr = it->second;
        idle.erase(it);
        idle_bytes -= nbytes;
      }
    }
    if (!ptr && nbytes) ptr = c10::alloc_cpu(nbytes);
    return {ptr, new Block{ptr, nbytes}, &give_back, c10::Device(DeviceType::CPU)};
  }
  static void give_back(void* ctx);
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }
};
Hf32CopyAllocator g_hf32_copy_allocator;

void Hf32CopyAllocator::give_back(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  auto& pool = g_hf32_copy_allocator;
  bool kept = false;
  if (block->ptr) {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.idle_bytes + block->nbytes <= kMaxIdleBytes) {
      pool.idle.emplace(block->nbytes, block->ptr);
      pool.idle_bytes += block->nbytes;
      kept = true;
    }
  }
  if (!kept && block->ptr) c10::free_cpu(block->ptr);
  delete block;
}

at::Tensor round_to_hf32(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "round_to_hf32 expects float32, got ", t.scalar_type());
  at::Tensor src = t.contiguous();
  at::Tensor out = at::detail::empty_generic(src.sizes(), &g_hf32_copy_allocator,
                                             c10::DispatchKeySet(c10::DispatchKey::CPU), at::kFloat, std::nullopt);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<float>());
  at::parallel_for(0, src.numel(), 1 << 18, [&](int64_t begin, int64_t end) {
    round_hf32_bits(in + begin, dst + begin, end - begin);
  });
  return out;
}

// Conv inputs and weights rounded in the forward are needed again by the backward: keep the
// rounded copies of a training step's convs (keyed by memory, layout and version) until then.
struct Hf32Cache {
  // An entry is the rounded copy of one tensor: its storage (held weakly, so that a freed storage's
  // address cannot come back as another's while the entry lives), data address, version and layout.
  // Memory addresses alone were not enough: a conv run with grad on and no backward (a validation
  // loss) left an entry, a new input at the same address took it, and its weight gradient was
  // computed from the old input (9 wrong gradients in 50 such steps).
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const void* data;
    int64_t version;
    std::vector<int64_t> sizes, strides;
    at::Tensor rounded;
  };
  std::mutex mu;
  std::deque<Entry> entries;
  int64_t bytes = 0;
  static constexpr int64_t kMaxBytes = int64_t(1) << 30;

  static bool matches(const Entry& e, const at::Tensor& t) {
    return !e.storage.expired() && e.storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
           e.data == t.const_data_ptr() && e.version == t._version() && e.sizes == t.sizes().vec() &&
           e.strides == t.strides().vec();
  }
  at::Tensor take(const at::Tensor& npu, const at::Tensor& cpu) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = entries.begin(); it != entries.end(); ++it) {
        if (matches(*it, npu)) {
          at::Tensor rounded = it->rounded;
          bytes -= rounded.nbytes();
          entries.erase(it);
          return rounded;
        }
      }
    }
    return round_to_hf32(cpu);
  }
  at::Tensor round_and_keep(const at::Tensor& npu, const at::Tensor& cpu) {
    at::Tensor rounded = round_to_hf32(cpu);
    std::lock_guard<std::mutex> lock(mu);
    // entries of tensors freed without a backward will never be taken
    for (auto it = entries.begin(); it != entries.end();) {
      if (it->storage.expired()) {
        bytes -= it->rounded.nbytes();
        it = entries.erase(it);
      } else {
        ++it;
      }
    }
    entries.push_back({c10::weak_intrusive_ptr<c10::StorageImpl>(npu.storage().getWeakStorageImpl()),
                       npu.const_data_ptr(), npu._version(), npu.sizes().vec(), npu.strides().vec(), rounded});
    bytes += rounded.nbytes();
    while (bytes > kMaxBytes && !entries.empty()) {
      bytes -= entries.front().rounded.nbytes();
      entries.pop_front();
    }
    return rounded;
  }
};
Hf32Cache g_hf32_cache;

// ------------------------------------------------------------------ npu <-> cpu aliasing
enum class Policy { None, Matmul, MatmulInplace };

at::Tensor make_tensor_on(c10::Storage storage, c10::DispatchKey key,
                          const at::Tensor& like_meta, caffe2::TypeMeta dtype) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                    c10::DispatchKeySet(key), dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like_meta.sizes(), like_meta.strides(),
                                                 like_meta.storage_offset());
  if (like_meta.is_conj()) t._set_conj(true);
  if (like_meta.is_neg()) t._set_neg(true);
  return t;
}

// Arguments reuse the CPU alias made for the same npu tensor the last time, while it
// still describes it (the same shared CPU storage, dtype, sizes, strides, offset and math bits):
// small models pass the same weights and activations to op after op, and making and freeing the
// alias tensor was the largest part of their per-op cost. Per thread and direct-mapped; an npu
// tensor's address is only compared, so a freed one costs nothing but a miss.
//
// A miss (a fresh activation or gradient, a new view) re-targets the alias its slot held when
// nothing else refers to that one any more, instead of freeing it and making another: making and
// freeing the alias tensor was a fifth of the emulator's instructions in an Adam step of a small
// MLP, where most arguments are fresh. The slot's tensor is then set up exactly as a new one is
// (storage, dtype, sizes, strides, offset, math bits); one a kernel changed in any other way
// (extra metadata, a Python object, keys) is not re-targeted.
struct AliasCache {
  static constexpr size_t kSlots = 256;  // a training step's live tensors, with few collisions
  struct Entry {
    const c10::TensorImpl* npu = nullptr;
    at::Tensor alias;
    c10::DispatchKeySet keys;  // the alias's keys when made, without the math bits
  };
  std::array<Entry, kSlots> entries;

  static size_t slot(const c10::TensorImpl* npu) {
    // Fibonacci hashing: TensorImpls are malloc'd objects a few hundred bytes apart
    return size_t((uint64_t(reinterpret_cast<uintptr_t>(npu) >> 4) * 0x9E3779B97F4A7C15ull) >> 56);
  }
  static_assert(kSlots == 256, "slot() keeps the top 8 bits of the hash");
  static c10::DispatchKeySet without_math_bits(c10::DispatchKeySet keys) {
    return keys.remove(c10::DispatchKey::Conjugate).remove(c10::DispatchKey::Negative);
  }
  static bool describes(const at::Tensor& a, const at::Tensor& t, const c10::StorageImpl* cpu_storage) {
    return a.storage().unsafeGetStorageImpl() == cpu_storage && a.dtype() == t.dtype() &&
           a.storage_offset() == t.storage_offset() && a.sizes() == t.sizes() && a.strides() == t.strides() &&
           a.is_conj() == t.is_conj() && a.is_neg() == t.is_neg();
  }
  // Held by this entry alone and as it was made: it can become another tensor's alias.
  static bool can_retarget(const Entry& e) {
    if (!e.alias.defined() || e.alias.use_count() != 1 || e.alias.weak_use_count() != 1) return false;
    c10::TensorImpl* impl = e.alias.unsafeGetTensorImpl();
    return without_math_bits(impl->key_set()) == e.keys && impl->allow_tensor_metadata_change() &&
           !impl->is_wrapped_number() && !impl->pyobj_slot()->load_pyobj() && !impl->get_backend_meta();
  }
  // The CPU alias of npu tensor `t`, whose storage's CPU alias is `cpu_storage`. The alias is an
  // inference tensor exactly when `t` is one, whatever the current mode: an alias made under
  // torch.inference_mode() for a weight, reused after it, made the optimizer's in-place update fail
  // ("Inplace update to inference tensor outside InferenceMode"), and a view of a normal tensor taken
  // under it (view_as_real) failed to share the npu base's version counter.
  const at::Tensor& alias_for(const at::Tensor& t, c10::StorageImpl* cpu_storage) {
    Entry& e = entries[slot(t.unsafeGetTensorImpl())];
    const bool inference = t.is_inference();
    if (e.npu == t.unsafeGetTensorImpl() && describes(e.alias, t, cpu_storage) && e.alias.is_inference() == inference)
      return e.alias;
    e.npu = t.unsafeGetTensorImpl();
    c10::Storage storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(cpu_storage));
    if (can_retarget(e) && e.alias.is_inference() == inference) {
      c10::TensorImpl* impl = e.alias.unsafeGetTensorImpl();
      impl->set_storage_and_dtype(std::move(storage), t.dtype());
      if (impl->sizes() == t.sizes() && impl->strides() == t.strides())
        impl->set_storage_offset(t.storage_offset());  // the slot's last tensor had this layout: common
      else
        impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
      impl->_set_conj(t.is_conj());
      impl->_set_neg(t.is_neg());
      return e.alias;
    }
    c10::InferenceMode mode(inference);  // a TensorImpl is an inference tensor if made in that mode
    e.alias = make_tensor_on(std::move(storage), c10::DispatchKey::CPU, t, t.dtype());
    e.keys = without_math_bits(e.alias.key_set());
    return e.alias;
  }
};
thread_local AliasCache t_alias_cache;

// A ZeroTensor (_efficientzerotensor: what sgn's and other backwards return for "no gradient") owns no
// memory: its data pointer is null. The ZeroTensor dispatch key materialises it for most ops, but lets
// some fall through to the device kernel with it (clone, copy_, dot, mul.Scalar, views, the factory
// and utility functions), whose CPU kernels handle a ZeroTensor themselves. So its CPU view is a CPU
// ZeroTensor of the same shape and dtype, never an alias of its (absent) memory, which the CPU kernel
// would read through the null pointer; and a ZeroTensor result comes back as an npu ZeroTensor.
at::Tensor efficient_zero_tensor(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                 std::optional<at::Layout> layout, std::optional<c10::Device> device,
                                 std::optional<bool> pin_memory);

at::Tensor cpu_zero_tensor_like(const at::Tensor& npu) {
  at::Tensor cpu = at::_efficientzerotensor(npu.sizes(), npu.options().device(c10::kCPU));
  if (npu.is_conj()) cpu._set_conj(true);
  if (npu.is_neg()) cpu._set_neg(true);
  return cpu;
}

at::Tensor npu_zero_tensor_like(const at::Tensor& cpu, c10::DeviceIndex device) {
  return efficient_zero_tensor(cpu.sizes(), cpu.scalar_type(), std::nullopt, c10::Device(kNpu, device), std::nullopt);
}

// Ops that take CPU index tensors with npu operands, as on CUDA.
bool takes_cpu_indices(const std::string& name) {
  return name == "aten::index" || name == "aten::_index_put_impl_" || name == "aten::index_put_" ||
         name == "aten::index_put" || name == "aten::_local_scalar_dense";
}

// Per-call translation state: one CPU storage per npu storage, so aliasing between the
// arguments of one op is kept exactly. npu arguments are referred to by their TensorImpl, never
// copied: the caller keeps them alive, and copying a tensor whose only owner is its Python object
// takes the GIL (torch increfs the PyObject when the C++ refcount goes from 1 to 2).
// CPU storages and aliases are referred to by raw pointer too (a refcount change is an atomic
// read-modify-write, and there were six per tensor argument): a shared CPU storage lives as long as
// its npu storage's block, a one-off one is held in one_off, and each alias is held by the caller
// until the call ends (the unboxed kernel's argument tuple), or by `kept` (keep_aliases: the boxed
// fallback, whose kernel pops the arguments; an alias a matmul cast replaces). Held, so an alias's
// address is never reused by a result within the call.
struct Translation {
  c10::DeviceIndex device = -1;
  c10::Device first_device{DeviceType::CPU};
  // Inline capacity for the common op, and for a foreach op over a small model's parameters (three
  // lists of 6 in Adam): no heap allocation per call for the maps.
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::StorageImpl*>, 24> npu_to_cpu;  // npu impl -> cpu impl
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::StorageImpl*>, 24> cpu_to_npu;  // cpu impl -> npu impl
  c10::SmallVector<std::pair<c10::TensorImpl*, c10::TensorImpl*>, 24> alias_of;  // (cpu alias, npu arg)
  c10::SmallVector<std::pair<c10::TensorImpl*, c10::TensorImpl*>, 8> written;  // (npu arg, cpu alias)
  c10::SmallVector<c10::Storage, 1> one_off;  // CPU storages made for this call alone
  bool keep_aliases = false;
  c10::SmallVector<at::Tensor, 4> kept;  // aliases held here rather than by the caller
  bool has_cpu_tensor = false;
  std::optional<c10::Device> written_elsewhere;  // a written argument (out=, in-place) not on the npu
  c10::DeviceIndex device_from_arg = -1;         // a device= argument naming an npu

  void note_device(const at::Tensor& t) {
    if (device < 0) {
      device = t.device().index();
      first_device = t.device();
    } else if (g_check_devices && t.device().index() != device) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
                         "two devices, ", first_device, " and ", t.device(), "!");
    }
  }

  at::Tensor to_cpu(const at::Tensor& t, bool is_write) {
    if (!t.defined()) return t;
    if (!t.is_privateuseone()) {
      // 0-dim CPU tensors are accepted as inputs (scalars), as on CUDA; never as a written argument.
      if (is_write) {
        if (!written_elsewhere) written_elsewhere = t.device();
      } else if (t.device().is_cpu() && t.dim() > 0) {
        has_cpu_tensor = true;
      }
      return t;
    }
    note_device(t);
    c10::TensorImpl* npu_impl = t.unsafeGetTensorImpl();
    // The same tensor passed twice (an input that is also out=, x.mul_(x)) gets one CPU alias, so
    // the CPU kernel sees the overlap: it refuses to resize an output that is also an input.
    for (auto& [alias, npu] : alias_of)
      if (npu == npu_impl) {
        if (is_write) written.emplace_back(npu_impl, alias);
        return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(alias));
      }
    if (t._is_zerotensor()) {
      // Immutable and memoryless: nothing to write back, nothing to cache. Held here for the call,
      // so an op returning it as it is (contiguous, alias) gives back the npu argument.
      at::Tensor zero = cpu_zero_tensor_like(t);
      kept.push_back(zero);
      alias_of.emplace_back(zero.unsafeGetTensorImpl(), npu_impl);
      return zero;
    }
    const c10::Storage& npu_storage = t.storage();
    c10::StorageImpl* key = npu_storage.unsafeGetStorageImpl();
    c10::StorageImpl* cpu_storage = nullptr;
    for (auto& [npu, cpu] : npu_to_cpu)
      if (npu == key) cpu_storage = cpu;
    if (!cpu_storage) {
      cpu_storage = shared_cpu_alias(npu_storage);
      if (!cpu_storage) {
        one_off.emplace_back(make_cpu_view(npu_storage));
        cpu_storage = one_off.back().unsafeGetStorageImpl();
      }
      npu_to_cpu.emplace_back(key, cpu_storage);
      cpu_to_npu.emplace_back(cpu_storage, key);
    }
    at::Tensor alias = t_alias_cache.alias_for(t, cpu_storage);
    if (keep_aliases) kept.push_back(alias);
    alias_of.emplace_back(alias.unsafeGetTensorImpl(), npu_impl);
    // A kernel may resize or re-stride a written alias: sync_written then gives the npu tensor the
    // same shape, so a cached alias still describes it, or no longer matches and is made anew.
    if (is_write) written.emplace_back(npu_impl, alias.unsafeGetTensorImpl());
    return alias;
  }

  c10::Device to_cpu(c10::Device d) {
    if (d.type() != kNpu) return d;
    device_from_arg = d.has_index() ? d.index() : t_current_device;
    return c10::Device(DeviceType::CPU);
  }

  // After the arguments: mixing npu with CPU tensors, or writing to a CPU tensor, is refused as on
  // CUDA; the op's device is the arguments', or the device= argument's, or the current one.
  void check_arguments(const std::string& op) {
    if (device < 0) device = device_from_arg >= 0 ? device_from_arg : t_current_device;
    if (has_cpu_tensor && g_check_devices)
      TORCH_CHECK(takes_cpu_indices(op), "Expected all tensors to be on the same device, but found at least "
                  "two devices, npu:", int(device), " and cpu! (when running ", op, ")");
    if (written_elsewhere && g_check_devices)
      TORCH_CHECK(false, "Expected out tensor to have device ", c10::Device(kNpu, device), ", but got ",
                  *written_elsewhere, " instead (when running ", op, ")");
  }

  const char* op_name = "this op";

  at::Tensor to_npu(const at::Tensor& cpu) {
    if (!cpu.defined() || !cpu.device().is_cpu()) return cpu;
    TORCH_CHECK_NOT_IMPLEMENTED(cpu.layout() == at::kStrided && !cpu.is_quantized(), op_name,
                                ": ", cpu.is_quantized() ? "quantized" : c10::str(cpu.layout()),
                                " tensors are not supported on the npukit emulated NPU (only dense "
                                "tensors); keep this part of the model on the CPU");
    for (auto& [alias, npu] : alias_of)
      if (alias == cpu.unsafeGetTensorImpl())  // in-place / out= result
        return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(npu));
    if (cpu._is_zerotensor()) return npu_zero_tensor_like(cpu, device >= 0 ? device : t_current_device);
    c10::StorageImpl* key = cpu.storage().unsafeGetStorageImpl();
    // The npu result is an inference tensor exactly when the CPU kernel's is: a view of a normal
    // tensor taken under torch.inference_mode() is a normal tensor, whose version counter autograd
    // then shares with its base (view_as_real of a complex buffer during evaluation)
    c10::InferenceMode mode(cpu.is_inference());
    for (auto& [cpu_impl, npu_storage] : cpu_to_npu)
      if (cpu_impl == key)
        return make_tensor_on(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(npu_storage)),
                              c10::DispatchKey::PrivateUse1, cpu, cpu.dtype());
    int dev = device >= 0 ? device : t_current_device;
    if (can_hand_over(cpu)) {
      at::Tensor npu = hand_over_to_npu(cpu, dev);
      cpu_to_npu.emplace_back(key, key);
      return npu;
    }
    auto npu_storage = adopt_cpu_storage(key, dev);
    cpu_to_npu.emplace_back(key, npu_storage.unsafeGetStorageImpl());
    return make_tensor_on(std::move(npu_storage), c10::DispatchKey::PrivateUse1, cpu, cpu.dtype());
  }

  // out= and in-place arguments whose CPU alias was resized or re-pointed by the kernel.
  void sync_written() {
    for (auto& [npu, alias] : written) {
      const c10::Storage& npu_storage_now = npu->storage();
      const c10::Storage& alias_storage = alias->storage();
      if (alias_storage.data() != npu_storage_now.data() || alias_storage.nbytes() != npu_storage_now.nbytes()) {
        c10::StorageImpl* key = alias_storage.unsafeGetStorageImpl();
        c10::Storage npu_storage;
        for (auto& [cpu_impl, s] : cpu_to_npu)
          if (cpu_impl == key && s->data() == alias_storage.data())
            npu_storage = c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
        if (!npu_storage) npu_storage = adopt_cpu_storage(key, npu->device().index());
        npu->set_storage_keep_dtype(npu_storage);
      }
      if (npu->sizes() != alias->sizes() || npu->strides() != alias->strides() ||
          npu->storage_offset() != alias->storage_offset())
        npu->set_sizes_and_strides(alias->sizes(), alias->strides(), alias->storage_offset());
    }
  }

  // Ops that write through an argument but return nothing (e.g. _foreach_add_): the device kernel
  // bumps the version of every tensor it wrote, as CUDA's foreach kernels do (the CPU kernel ran on
  // the aliases and bumped theirs), so autograd sees a foreach update overwrite a saved tensor.
  void bump_written_versions() {
    for (auto& [npu, alias] : written)
      if (!npu->is_inference()) npu->bump_version();
  }

  void saturate_written() {
    if (g_saturation)
      for (auto& [npu, alias] : written)
        saturate_half(at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(alias)));
  }
};

// The matmul policy: fp16/bf16 inputs computed in fp32 and the result rounded once (fp32
// accumulation), fp32 inputs rounded to HF32 when matmul HF32 is on, float64 refused.
struct MatmulCast {
  c10::ScalarType downcast = c10::ScalarType::Undefined;  // the result's dtype when inputs went to fp32
  bool to_float = false, to_hf32 = false;

  MatmulCast(c10::ScalarType dtype, Policy policy, const std::string& op) {
    if (dtype == at::kDouble && g_reject_fp64) {
      TORCH_CHECK(false, op, ": float64 is not supported by the NPU cube unit "
                  "(matmul/convolution; CANN's aclnnDot/aclnnMm take fp16/bf16/fp32 only); cast the "
                  "inputs to float32. For float64 checks such as torch.autograd.gradcheck, run with "
                  "the NPU numerics off: npu-run --golden, pytest --npu-golden, NPUKIT_GOLDEN=1 or "
                  "`with npukit.npu_backend.numerics.golden():` [npukit emulated device]");
    }
    if (policy != Policy::Matmul) return;  // out=/in-place variants: checked, computed as given
    bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
    to_float = reduced && g_fp32_accumulate;
    to_hf32 = dtype == at::kFloat && g_matmul_hf32;
    if (to_float) downcast = dtype;
  }
  at::Tensor input(const at::Tensor& t) const {
    if (!(to_float || to_hf32) || !t.defined() || !at::isFloatingType(t.scalar_type())) return t;
    return to_float ? t.to(at::kFloat) : round_to_hf32(t);
  }
  at::Tensor result(const at::Tensor& t) const {
    return downcast != c10::ScalarType::Undefined && t.defined() ? t.to(downcast) : t;
  }
};

bool is_generator_type(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::GeneratorType) return true;
  if (auto opt = type->cast<c10::OptionalType>())
    return opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
  return false;
}

// ------------------------------------------------------------------ generators
// An npu generator's state is torch_npu's (and CUDA's): 16 bytes, the seed and a philox offset
// that each random op advances by its element count rounded up to 4. DTensor's random ops (FSDP2's
// meta-device init, then reset_parameters) read and write that offset to give each shard its own
// part of one stream. The numbers come from a CPU generator the CPU kernels draw from: seeded
// with the seed, it streams exactly as torch's CPU generator does; once the state is read or set,
// it continues from a state made from (seed, offset) alone, so that equal states draw equal numbers
// on every rank and a state set back draws again what it drew.
struct NpuGeneratorImpl final : public c10::GeneratorImpl {
  at::Generator inner;
  uint64_t seed_;
  uint64_t offset_ = 0;
  NpuGeneratorImpl(c10::DeviceIndex idx, uint64_t seed)
      : c10::GeneratorImpl(c10::Device(kNpu, idx), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        inner(at::make_generator<at::CPUGeneratorImpl>(seed)), seed_(seed) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
    inner.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    offset_ = offset;
    continue_from_state();
  }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    uint64_t random = c10::detail::getNonDeterministicRandom();
    set_current_seed(random);
    return random;
  }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && state.numel() == 16 && state.is_contiguous(),
                "an npu generator's RNG state is 16 bytes of uint8 (its seed and philox offset, as torch_npu's), "
                "got ", state.numel(), " elements of ", state.dtype().name());
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
    continue_from_state();
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr<uint8_t>(), &seed_, 8);
    std::memcpy(state.data_ptr<uint8_t>() + 8, &offset_, 8);
    // the numbers drawn from now on are the ones this state stands for
    const_cast<NpuGeneratorImpl*>(this)->continue_from_state();
    return state.getIntrusivePtr();
  }
  // The CPU generator a random op over `numel` elements draws from; the offset moves past it.
  at::Generator draw(int64_t numel) {
    std::lock_guard<std::mutex> lock(mutex_);
    offset_ += ((std::max<int64_t>(numel, 1) + 3) / 4) * 4;
    return inner;
  }
  static c10::DeviceType device_type() { return kNpu; }

  // The full state for npukit's own readers (--replay-step, the monitor's checkpoints), which must
  // not change the run they record: unlike get_state() it keeps the CPU generator's stream, so the
  // generator draws on as if unread. Layout (uint8): version, seed, offset (3 x uint64, native
  // byte order), then the CPU generator's own state.
  static constexpr uint64_t kFullStateVersion = 1;
  at::Tensor full_state() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::lock_guard<std::mutex> inner_lock(inner.mutex());
    at::Tensor cpu = inner.get_state();
    auto state = at::empty({24 + cpu.numel()}, at::TensorOptions().dtype(at::kByte));
    auto* bytes = state.data_ptr<uint8_t>();
    std::memcpy(bytes, &kFullStateVersion, 8);
    std::memcpy(bytes + 8, &seed_, 8);
    std::memcpy(bytes + 16, &offset_, 8);
    std::memcpy(bytes + 24, cpu.data_ptr<uint8_t>(), cpu.numel());
    return state;
  }
  // Sets a full_state() back: the generator then draws exactly what the recorded one drew next.
  void set_full_state(const at::Tensor& state) {
    TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kByte && state.dim() == 1 && state.numel() > 24,
                "an npu generator's full state (npukit's replay) is a 1-d uint8 CPU tensor of more than 24 bytes, got ",
                state.numel(), " elements of ", state.scalar_type(), " on ", state.device());
    at::Tensor contiguous = state.contiguous();
    const auto* bytes = contiguous.data_ptr<uint8_t>();
    uint64_t version;
    std::memcpy(&version, bytes, 8);
    TORCH_CHECK(version == kFullStateVersion, "an npu generator's full state of version ", version,
                "; this npukit reads version ", kFullStateVersion);
    std::lock_guard<std::mutex> lock(mutex_);
    std::lock_guard<std::mutex> inner_lock(inner.mutex());
    inner.set_state(contiguous.slice(0, 24).clone());  // checks the CPU state's size before anything changes
    std::memcpy(&seed_, bytes + 8, 8);
    std::memcpy(&offset_, bytes + 16, 8);
  }

 private:
  void continue_from_state() {
    if (offset_ == 0) {  // freshly seeded: the CPU generator's own stream
      inner.set_current_seed(seed_);
      return;
    }
    at::mt19937_data_pod data{};
    data.seed_ = seed_;
    data.seeded_ = true;
    data.left_ = 1;
    data.next_ = 0;
    at::Philox4_32 philox(seed_, offset_);
    for (auto& word : data.state_) word = philox();
    auto* cpu = static_cast<at::CPUGeneratorImpl*>(inner.unsafeGetGeneratorImpl());
    at::mt19937 engine;
    engine.set_data(data);
    cpu->set_engine(engine);
    cpu->set_next_float_normal_sample(std::nullopt);
    cpu->set_next_double_normal_sample(std::nullopt);
  }
  NpuGeneratorImpl* clone_impl() const override {
    auto* copy = new NpuGeneratorImpl(device_.index(), 0);
    copy->inner = inner.clone();
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
};

std::array<at::Generator, kMaxDevices> g_default_generators;
std::array<std::once_flag, kMaxDevices> g_generator_once;

const at::Generator& default_generator(c10::DeviceIndex idx) {
  if (idx < 0) idx = t_current_device;
  std::call_once(g_generator_once[idx], [idx] {
    g_default_generators[idx] = at::make_generator<NpuGeneratorImpl>(idx, c10::default_rng_seed_val);
  });
  return g_default_generators[idx];
}

// The generator a CPU kernel gets for `gen` (an npu generator gives its CPU one, advanced past
// a draw of `numel` elements).
at::Generator cpu_generator_for(const at::Generator& gen, int64_t numel) {
  if (gen.defined() && gen.device().type() == kNpu) {
    return static_cast<NpuGeneratorImpl*>(gen.unsafeGetGeneratorImpl())->draw(numel);
  }
  return gen;
}

// ------------------------------------------------------------------ the fallback
void run_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, Policy policy) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  const size_t begin = stack->size() - num_args;
  Translation tr;
  tr.op_name = schema.name().c_str();
  tr.keep_aliases = true;  // the kernel pops the arguments from the stack
  c10::SmallVector<size_t, 2> generator_slots, default_generator_slots;
  // The npu arguments, moved off the stack (no refcount change) and kept alive for the call.
  c10::SmallVector<c10::IValue, 4> npu_arguments;

  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& value = (*stack)[begin + i];
    const auto* alias = arguments[i].alias_info();
    bool is_write = alias && alias->isWrite();
    if (value.isTensor()) {
      npu_arguments.push_back(std::move(value));
      value = tr.to_cpu(npu_arguments.back().toTensor(), is_write);
    } else if (value.isTensorList()) {
      npu_arguments.push_back(std::move(value));
      auto list = npu_arguments.back().toTensorList();
      c10::List<at::Tensor> converted;
      converted.reserve(list.size());
      for (const at::Tensor& t : list) converted.push_back(tr.to_cpu(t, is_write));
      value = converted;
    } else if (value.isList() && value.toListRef().size() > 0 &&
               arguments[i].type()->containedTypes().size() == 1 &&
               arguments[i].type()->containedType(0)->kind() == c10::TypeKind::OptionalType) {
      npu_arguments.push_back(std::move(value));
      auto list = c10::impl::toTypedList<std::optional<at::Tensor>>(npu_arguments.back().toList());
      c10::List<std::optional<at::Tensor>> converted;
      for (const std::optional<at::Tensor>& t : list) {
        if (t.has_value()) converted.push_back(tr.to_cpu(*t, is_write));
        else converted.push_back(std::nullopt);
      }
      value = converted;
    } else if (value.isDevice()) {
      value = tr.to_cpu(value.toDevice());
    } else if (value.isGenerator()) {
      generator_slots.push_back(begin + i);
    } else if (value.isNone() && is_generator_type(arguments[i].type())) {
      default_generator_slots.push_back(begin + i);
    }
  }
  tr.check_arguments(schema.name());
  if (!generator_slots.empty() || !default_generator_slots.empty()) {
    int64_t numel = 0;  // a random op draws about one number per element of its largest tensor
    for (size_t i = begin; i < stack->size(); ++i)
      if ((*stack)[i].isTensor()) numel = std::max(numel, (*stack)[i].toTensor().numel());
    for (size_t slot : generator_slots)
      (*stack)[slot] = cpu_generator_for((*stack)[slot].toGenerator(), numel);
    for (size_t slot : default_generator_slots)
      (*stack)[slot] = cpu_generator_for(default_generator(tr.device), numel);
  }

  std::optional<MatmulCast> cast;
  if (policy != Policy::None) {
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    for (size_t i = 0; i < num_args; ++i) {
      const c10::IValue& value = (*stack)[begin + i];
      if (value.isTensor() && value.toTensor().defined()) {
        dtype = value.toTensor().scalar_type();
        break;
      }
    }
    cast.emplace(dtype, policy, schema.name());
    for (size_t i = 0; i < num_args; ++i) {
      c10::IValue& value = (*stack)[begin + i];
      if (value.isTensor()) value = cast->input(value.toTensor());
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  const size_t num_returns = schema.returns().size();
  const size_t ret_begin = stack->size() - num_returns;
  if (cast && num_returns > 0 && (*stack)[ret_begin].isTensor())
    (*stack)[ret_begin] = cast->result((*stack)[ret_begin].toTensor());
  tr.sync_written();
  for (size_t j = 0; j < num_returns; ++j) {
    c10::IValue& value = (*stack)[ret_begin + j];
    const auto* alias = schema.returns()[j].alias_info();
    bool is_view = alias && !alias->isWrite();
    if (value.isTensor()) {
      const at::Tensor& cpu = value.toTensor();
      if (!is_view) saturate_half(cpu);
      value = tr.to_npu(cpu);
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      c10::List<at::Tensor> converted;
      converted.reserve(list.size());
      for (const at::Tensor& t : list) {
        if (!is_view) saturate_half(t);
        converted.push_back(tr.to_npu(t));
      }
      value = converted;
    }
  }
  if (num_returns == 0) {
    tr.saturate_written();
    tr.bump_written_versions();
  }
}

void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_on_cpu(op, stack, Policy::None);
}
void npu_matmul_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_on_cpu(op, stack, Policy::Matmul);
}
void npu_matmul_inplace_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_on_cpu(op, stack, Policy::MatmulInplace);
}

// ------------------------------------------------------------------ unboxed kernels
// The same translation as the fallback, for the ops a training step calls all the time. The boxed
// fallback copies each tensor argument onto a Stack and releases it after: for a tensor owned only
// by its Python object, each of those takes the GIL (torch increfs the PyObject when the C++
// refcount goes 1 -> 2), and the boxing itself costs more than the small op. An unboxed kernel reads
// the arguments by reference and calls the CPU kernel unboxed.

// What the schema says of an op, read once.
struct OpFacts {
  std::string name;
  c10::SmallVector<bool, 8> written;      // per argument: written (out=, in-place)
  c10::SmallVector<bool, 4> view_return;  // per return: a view of an argument
};

OpFacts read_op_facts(const char* name, const char* overload) {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).schema();
  OpFacts facts{schema.name(), {}, {}};
  for (const auto& argument : schema.arguments())
    facts.written.push_back(argument.alias_info() && argument.alias_info()->isWrite());
  for (const auto& ret : schema.returns())
    facts.view_return.push_back(ret.alias_info() && !ret.alias_info()->isWrite());
  return facts;
}

// An argument as the CPU kernel takes it. Types with no specialisation pass through unchanged.
struct CpuTensorList {  // a Tensor[] argument, for at::TensorList and at::ITensorListRef parameters
  c10::SmallVector<at::Tensor, 8> tensors;  // inline: no heap allocation for a small model's lists
  operator at::TensorList() const { return tensors; }
  operator at::ITensorListRef() const { return at::ITensorListRef(at::TensorList(tensors)); }
};

template <class T>
struct CpuArg {
  static_assert(!std::is_same_v<std::decay_t<T>, std::optional<at::Generator>> &&
                    !std::is_same_v<std::decay_t<T>, c10::List<std::optional<at::Tensor>>>,
                "ops with generators or Tensor?[] arguments stay on the boxed fallback");
  using type = T;
  static T convert(Translation&, T value, bool) { return value; }
};
template <>
struct CpuArg<const at::Tensor&> {
  using type = at::Tensor;
  static at::Tensor convert(Translation& tr, const at::Tensor& t, bool write) { return tr.to_cpu(t, write); }
};
template <>
struct CpuArg<at::Tensor&> {
  using type = at::Tensor;
  static at::Tensor convert(Translation& tr, const at::Tensor& t, bool write) { return tr.to_cpu(t, write); }
};
template <>
struct CpuArg<const std::optional<at::Tensor>&> {
  using type = std::optional<at::Tensor>;
  static type convert(Translation& tr, const std::optional<at::Tensor>& t, bool write) {
    if (!t.has_value()) return t;
    return tr.to_cpu(*t, write);
  }
};
template <class List>
CpuTensorList convert_list(Translation& tr, const List& list, bool write) {
  CpuTensorList cpu;
  cpu.tensors.reserve(list.size());
  for (const at::Tensor& t : list) cpu.tensors.push_back(tr.to_cpu(t, write));
  return cpu;
}
template <>
struct CpuArg<at::TensorList> {
  using type = CpuTensorList;
  static type convert(Translation& tr, at::TensorList list, bool write) { return convert_list(tr, list, write); }
};
template <>
struct CpuArg<const at::ITensorListRef&> {
  using type = CpuTensorList;
  static type convert(Translation& tr, const at::ITensorListRef& list, bool write) {
    return convert_list(tr, list, write);
  }
};
template <>
struct CpuArg<std::optional<c10::Device>> {
  using type = std::optional<c10::Device>;
  static type convert(Translation& tr, std::optional<c10::Device> d, bool) {
    if (!d) return d;
    return tr.to_cpu(*d);
  }
};

// A result back on the npu, saturated unless it is a view of an argument (as in the fallback).
inline at::Tensor npu_result(Translation& tr, const at::Tensor& cpu, bool is_view) {
  if (!is_view) saturate_half(cpu);
  return tr.to_npu(cpu);
}
template <class R>
struct NpuReturn {  // not a tensor (item()'s Scalar)
  static R convert(Translation&, R value, const OpFacts&) { return value; }
};
template <>
struct NpuReturn<at::Tensor> {
  static at::Tensor convert(Translation& tr, const at::Tensor& cpu, const OpFacts& facts) {
    return npu_result(tr, cpu, facts.view_return[0]);
  }
};
template <>
struct NpuReturn<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> convert(Translation& tr, const std::vector<at::Tensor>& cpu, const OpFacts& facts) {
    std::vector<at::Tensor> npu;
    npu.reserve(cpu.size());
    for (const at::Tensor& t : cpu) npu.push_back(npu_result(tr, t, facts.view_return[0]));
    return npu;
  }
};
template <class... Ts>
struct NpuReturn<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...), "tuples of tensors returned by value only");
  static std::tuple<Ts...> convert(Translation& tr, const std::tuple<Ts...>& cpu, const OpFacts& facts) {
    return convert(tr, cpu, facts, std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> convert(Translation& tr, const std::tuple<Ts...>& cpu, const OpFacts& facts,
                                   std::index_sequence<I...>) {
    return {npu_result(tr, std::get<I>(cpu), facts.view_return[I])...};
  }
};

template <class T>
void cast_matmul_input(Translation& tr, const MatmulCast& cast, T& value) {
  if constexpr (std::is_same_v<T, at::Tensor>)
    if (cast.to_float || cast.to_hf32) {
      tr.kept.push_back(std::move(value));  // the alias stays alive (see Translation)
      value = cast.input(tr.kept.back());
    }
}
template <class T>
void first_tensor_dtype(const T& value, c10::ScalarType& dtype) {
  if constexpr (std::is_same_v<T, at::Tensor>)
    if (dtype == c10::ScalarType::Undefined && value.defined()) dtype = value.scalar_type();
  if constexpr (std::is_same_v<T, std::optional<at::Tensor>>)
    if (dtype == c10::ScalarType::Undefined && value && value->defined()) dtype = value->scalar_type();
}

template <class Op, Policy policy, class Schema = typename Op::schema>
struct Unboxed;

template <class Op, Policy policy, class R, class... Args>
struct Unboxed<Op, policy, R(Args...)> {
  static R kernel(Args... args) { return run(std::index_sequence_for<Args...>{}, args...); }

  template <size_t... I>
  static R run(std::index_sequence<I...>, Args... args) {
    static const OpFacts facts = read_op_facts(Op::name, Op::overload_name);
    Translation tr;
    tr.op_name = facts.name.c_str();
    // braced initialisation: the arguments are translated in order, as in the fallback
    std::tuple<typename CpuArg<Args>::type...> cpu{CpuArg<Args>::convert(tr, args, facts.written[I])...};
    tr.check_arguments(facts.name);
    std::optional<MatmulCast> cast;
    if constexpr (policy != Policy::None) {
      c10::ScalarType dtype = c10::ScalarType::Undefined;
      (first_tensor_dtype(std::get<I>(cpu), dtype), ...);
      cast.emplace(dtype, policy, facts.name);
      (cast_matmul_input(tr, *cast, std::get<I>(cpu)), ...);
    }
    auto call_cpu_kernel = [&]() -> decltype(auto) {
      return Op::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), std::get<I>(cpu)...);
    };
    if constexpr (std::is_void_v<R>) {
      call_cpu_kernel();
      tr.sync_written();
      tr.saturate_written();
      tr.bump_written_versions();
    } else if constexpr (std::is_same_v<R, at::Tensor&>) {
      at::Tensor& result = call_cpu_kernel();  // one of the written aliases
      tr.sync_written();
      saturate_half(result);
      at::Tensor* npu = nullptr;
      ((npu = npu ? npu : same_impl<Args>(std::get<I>(cpu), result, args)), ...);
      TORCH_INTERNAL_ASSERT(npu, facts.name, " returned a tensor that is none of its written arguments");
      return *npu;
    } else {
      R result = call_cpu_kernel();
      if constexpr (std::is_same_v<R, at::Tensor>)
        if (cast) result = cast->result(result);
      tr.sync_written();
      return NpuReturn<R>::convert(tr, result, facts);
    }
  }

  // The caller's argument whose alias is `result`, for ops returning a written argument.
  template <class A, class C>
  static at::Tensor* same_impl(C& cpu, const at::Tensor& result, A& arg) {
    if constexpr (std::is_same_v<A, at::Tensor&>)
      if (cpu.unsafeGetTensorImpl() == result.unsafeGetTensorImpl()) return &arg;
    return nullptr;
  }
};

// ------------------------------------------------------------------ explicit kernels
at::Tensor empty_memory_format(c10::SymIntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<at::MemoryFormat> memory_format) {
  int dev = device && device->has_index() ? device->index() : t_current_device;
  check_index(dev);
  return at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), allocator_for(dev),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin_memory) {
  int dev = device && device->has_index() ? device->index() : t_current_device;
  check_index(dev);
  return at::detail::empty_strided_generic(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           allocator_for(dev),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// A ZeroTensor (what sgn's and other backwards return for "no gradient") has no memory: it carries
// the ZeroTensor key, so the ZeroTensor fallback materialises it before any kernel reads it.
at::Tensor efficient_zero_tensor(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                 std::optional<at::Layout> layout, std::optional<c10::Device> device,
                                 std::optional<bool> pin_memory) {
  c10::DeviceIndex index = device && device->has_index() ? device->index() : t_current_device;
  check_index(index);
  at::native::ZeroTensorAllocator allocator(c10::Device(kNpu, index));
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, &allocator, keys, dtype.value_or(c10::get_default_dtype_as_scalartype()),
                                   std::nullopt);
}

// native_dropout (nn.Dropout, F.dropout, attention dropout) as the CPU computes it, its mask drawn
// from the npu generator: its schema has no generator argument, so the boxed fallback's CPU kernel
// drew from the CPU's default generator, and torch.npu.manual_seed did not change the masks (a
// seeded npu run depended on the CPU seed instead, where torch_npu's dropout follows the npu one).
// The CPU kernel: mask = bernoulli(1 - p) in the input's dtype, out = input * mask * 1 / (1 - p)
// (0 when p is 1), the mask returned as bool; outside training a copy and an all-true mask; an
// empty input returned as it is with an empty mask of its dtype.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return {input, at::empty_like(input)};
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  double keep = 1. - p;
  double scale = keep == 0 ? 0. : 1. / keep;
  at::Tensor mask = at::empty_like(input);  // the input's layout, as the CPU keeps it
  mask.bernoulli_(keep);  // on npu: the boxed fallback draws from the npu generator
  // scaled by a wrapped number, as the CPU kernel's mul_(double) computes (in the op's fp32 opmath;
  // the device's Scalar overload rounds a scalar to an fp16/bf16 tensor's dtype first, as CANN's does)
  at::Tensor output = input.mul(mask).mul_(at::native::wrapped_scalar_tensor(scale));
  return {output, mask.to(at::kBool)};
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      storage_offset ? std::optional<int64_t>(storage_offset->expect_int()) : std::nullopt);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  // The storage's allocator is the npu allocator, so growth is accounted on the device.
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source, c10::SymInt storage_offset,
                               c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage_full(at::Tensor& self, at::Storage source) {
  int64_t numel = int64_t(source.nbytes() / self.dtype().itemsize());
  return at::native::set_storage_cpu_(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_storage_cpu_(self, source.storage(), source.storage_offset(), source.sizes(),
                                      source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  int dev = self.device().index();
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, allocator_for(dev)->allocate(0), allocator_for(dev), true));
  return at::native::set_storage_cpu_(self, storage, 0, {0}, {});
}

// The CPU view of an npu tensor for the explicit kernels below, which only read it or write its
// values: the storage's shared CPU alias, so two tensors on one storage stay one storage for the CPU
// kernel (a.copy_(a.t()) must be refused as overlapping, as on the CPU: with a storage each it
// silently wrote a wrong result).
at::Tensor cpu_alias(const at::Tensor& t) {
  if (!t.is_privateuseone()) return t;
  if (t._is_zerotensor()) return cpu_zero_tensor_like(t);
  c10::InferenceMode mode(t.is_inference());  // an inference tensor exactly when t is (AliasCache::alias_for)
  return make_tensor_on(cpu_storage_for(t.storage()), c10::DispatchKey::CPU, t, t.dtype());
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  auto dst_cpu = cpu_alias(dst);
  dst_cpu.copy_(cpu_alias(self));
  if (dst.is_privateuseone() && dst.scalar_type() == at::kHalf && self.scalar_type() != at::kHalf)
    saturate_half(dst_cpu);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// A result computed on CPU aliases, adopted by the npu device of `npu_like` (no copy).
at::Tensor wrap_like(const at::Tensor& cpu, const at::Tensor& npu_like) {
  if (!cpu.defined()) return cpu;
  Translation tr;
  tr.device = npu_like.device().index();
  return tr.to_npu(cpu);
}

// Convolution on a non-CPU/CUDA device dispatches to the *_overrideable ops.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                                    at::IntArrayRef output_padding, int64_t groups) {
  auto dtype = input.scalar_type();
  TORCH_CHECK(!(dtype == at::kDouble && g_reject_fp64),
              "aten::convolution: float64 is not supported by the NPU cube unit (matmul/convolution); "
              "cast the inputs to float32 [npukit emulated device]");
  at::Tensor x = cpu_alias(input), w = cpu_alias(weight);
  std::optional<at::Tensor> b = bias && bias->defined() ? std::optional<at::Tensor>(cpu_alias(*bias)) : std::nullopt;
  bool reduced = (dtype == at::kHalf || dtype == at::kBFloat16) && g_fp32_accumulate;
  if (reduced) {
    x = x.to(at::kFloat);
    w = w.to(at::kFloat);
    if (b) b = b->to(at::kFloat);
  } else if (dtype == at::kFloat && g_conv_hf32) {
    bool training = at::GradMode::is_enabled() && (input.requires_grad() || weight.requires_grad());
    x = training ? g_hf32_cache.round_and_keep(input, x) : round_to_hf32(x);
    w = training ? g_hf32_cache.round_and_keep(weight, w) : round_to_hf32(w);
  }
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = at::convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups);
  }
  if (reduced) out = out.to(dtype);
  saturate_half(out);
  return wrap_like(out, input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  auto dtype = input.scalar_type();
  at::Tensor g = cpu_alias(grad_output), x = cpu_alias(input), w = cpu_alias(weight);
  bool reduced = (dtype == at::kHalf || dtype == at::kBFloat16) && g_fp32_accumulate;
  if (reduced) {
    g = g.to(at::kFloat);
    x = x.to(at::kFloat);
    w = w.to(at::kFloat);
  } else if (dtype == at::kFloat && g_conv_hf32) {
    g = round_to_hf32(g);
    x = g_hf32_cache.take(input, x);
    w = g_hf32_cache.take(weight, w);
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> grads;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::vector<int64_t> bias_sizes{w.size(transposed ? 1 : 0) * (transposed ? groups : 1)};
    grads = at::convolution_backward(g, x, w, at::OptionalIntArrayRef(bias_sizes), stride, padding,
                                     dilation, transposed, output_padding, groups, output_mask);
  }
  auto finish = [&](at::Tensor t) {
    if (!t.defined()) return t;
    if (reduced) t = t.to(dtype);
    saturate_half(t);
    return wrap_like(t, input);
  };
  return {finish(std::get<0>(grads)), finish(std::get<1>(grads)), finish(std::get<2>(grads))};
}

// `cpu_param.data = npu_tensor` (FSDP moves parameters this way): a dense CPU tensor and a dense
// npu tensor may exchange their implementation, as torch_npu allows.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense_on = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && !t.is_quantized() && (t.is_cpu() || t.is_privateuseone());
  };
  if (dense_on(self) && dense_on(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// ------------------------------------------------------------------ recurrent cells
// ATen's LSTM/GRU take the fused-cell path for every non-CPU device; these are the fused
// cells' math (same gate order and workspace layout as the CUDA kernels) on the CPU aliases.

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  at::Tensor gates = cpu_alias(input_gates) + cpu_alias(hidden_gates);
  if (input_bias && input_bias->defined()) gates = gates + cpu_alias(*input_bias);
  if (hidden_bias && hidden_bias->defined()) gates = gates + cpu_alias(*hidden_bias);
  auto chunks = gates.chunk(4, 1);
  at::Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(), o = chunks[3].sigmoid();
  at::Tensor cy = f * cpu_alias(cx) + i * g;
  at::Tensor hy = o * cy.tanh();
  at::Tensor workspace = at::cat({i, f, g, o}, 1);
  return {wrap_like(hy, cx), wrap_like(cy, cx), wrap_like(workspace, cx)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy_opt, const std::optional<at::Tensor>& grad_cy_opt,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  bool has_hy = grad_hy_opt && grad_hy_opt->defined();
  bool has_cy = grad_cy_opt && grad_cy_opt->defined();
  if (!has_hy && !has_cy) return {at::Tensor(), at::Tensor(), at::Tensor()};
  auto chunks = cpu_alias(workspace).chunk(4, 1);
  at::Tensor i = chunks[0], f = chunks[1], g = chunks[2], o = chunks[3];
  at::Tensor tanh_cy = cpu_alias(cy).tanh();
  at::Tensor grad_hy = has_hy ? cpu_alias(*grad_hy_opt) : at::zeros_like(tanh_cy);
  at::Tensor gcx = grad_hy * o * (1 - tanh_cy * tanh_cy);
  if (has_cy) gcx = gcx + cpu_alias(*grad_cy_opt);
  at::Tensor gi = gcx * g * i * (1 - i);
  at::Tensor gf = gcx * cpu_alias(cx) * f * (1 - f);
  at::Tensor gg = gcx * i * (1 - g * g);
  at::Tensor go = grad_hy * tanh_cy * o * (1 - o);
  at::Tensor grad_gates = at::cat({gi, gf, gg, go}, 1);
  at::Tensor grad_cx = gcx * f;
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {wrap_like(grad_gates, cx), wrap_like(grad_cx, cx), wrap_like(grad_bias, cx)};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  at::Tensor igates = cpu_alias(input_gates), hgates = cpu_alias(hidden_gates), h = cpu_alias(hx);
  if (input_bias && input_bias->defined()) igates = igates + cpu_alias(*input_bias);
  if (hidden_bias && hidden_bias->defined()) hgates = hgates + cpu_alias(*hidden_bias);
  auto ic = igates.chunk(3, 1);
  auto hc = hgates.chunk(3, 1);
  at::Tensor r = (ic[0] + hc[0]).sigmoid();
  at::Tensor z = (ic[1] + hc[1]).sigmoid();
  at::Tensor n = (ic[2] + r * hc[2]).tanh();
  at::Tensor hy = n + z * (h - n);
  at::Tensor workspace = at::cat({r, z, n, h, hc[2]}, 1);
  return {wrap_like(hy, hx), wrap_like(workspace, hx)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy_npu, const at::Tensor& workspace, bool has_bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  auto chunks = cpu_alias(workspace).chunk(5, 1);
  at::Tensor r = chunks[0], z = chunks[1], n = chunks[2], h = chunks[3], hn = chunks[4];
  at::Tensor grad_hy = cpu_alias(grad_hy_npu);
  at::Tensor grad_hx = grad_hy * z;
  at::Tensor g_in = grad_hy * (1 - z) * (1 - n * n);
  at::Tensor g_r = g_in * hn * r * (1 - r);
  at::Tensor g_z = grad_hy * (h - n) * z * (1 - z);
  at::Tensor grad_input_gates = at::cat({g_r, g_z, g_in}, 1);
  at::Tensor grad_hidden_gates = at::cat({g_r, g_z, g_in * r}, 1);
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {wrap_like(grad_input_gates, grad_hy_npu), wrap_like(grad_hidden_gates, grad_hy_npu),
          wrap_like(grad_hx, grad_hy_npu), wrap_like(grad_input_bias, grad_hy_npu),
          wrap_like(grad_hidden_bias, grad_hy_npu)};
}

// ------------------------------------------------------------------ device guard
struct NpuEvent {
  std::chrono::steady_clock::time_point time;
  bool recorded = false;
};

struct NpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kNpu, t_current_device);
    if (d.has_index()) t_current_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNpu, t_current_device); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) {
      check_index(d.index());
      t_current_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d.has_index() ? d : getDevice());
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    static std::atomic<int64_t> next_id{1};
    return c10::Stream(c10::Stream::UNSAFE, d.has_index() ? d : getDevice(), next_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return c10::DeviceIndex(g_device_count.load()); }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<NpuEvent*>(event);
  }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (!*event) *event = new NpuEvent();
    auto* e = static_cast<NpuEvent*>(*event);
    e->time = std::chrono::steady_clock::now();
    e->recorded = true;
  }
  void block(void*, const c10::Stream&) const override {}  // work is synchronous
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* e1, void* e2, const c10::DeviceIndex) const override {
    TORCH_CHECK(e1 && e2, "Both events must be recorded before calculating elapsed time.");
    auto* a = static_cast<NpuEvent*>(e1);
    auto* b = static_cast<NpuEvent*>(e2);
    return std::chrono::duration<double, std::milli>(b->time - a->time).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

// ------------------------------------------------------------------ hooks
struct NpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::DeviceIndex(g_device_count.load()); }
  void setCurrentDevice(c10::DeviceIndex d) const override { t_current_device = d; }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = t_current_device;
    t_current_device = d;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override {
    return default_generator(idx);
  }
  at::Generator getNewGenerator(c10::DeviceIndex idx) const override {
    if (idx < 0) idx = t_current_device;
    return at::make_generator<NpuGeneratorImpl>(idx, c10::default_rng_seed_val);
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kNpu, t_current_device); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    return g_pinned.count(data) > 0;
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  // Storage resize (e.g. FSDP's storage._resize_(0)): new memory always comes from the npu
  // allocator, even for 0 bytes, so the storage stays on its npu device.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    int dev = impl->device().has_index() ? impl->device().index() : t_current_device;
    c10::DataPtr fresh = allocator_for(dev)->allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// An op with both a CPU kernel and a CompositeExplicitAutograd kernel would run the composite
// decomposition on npu (e.g. native_layer_norm), which computes differently from the CPU
// kernel. Route such ops through the fallback so npu results are the CPU kernel's, bit for bit.
std::vector<std::string> route_composite_ops_to_cpu_kernels() {
  static std::unique_ptr<torch::Library> library;
  static std::vector<std::string> routed;
  if (library) return routed;
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = c10::Dispatcher::singleton().findOp(name);
    if (!handle) continue;
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    std::string op = name.name.substr(6);
    if (!name.overload_name.empty()) op += "." + name.overload_name;
    library->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
    routed.push_back(op);
  }
  return routed;
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < kMaxDevices; ++i) g_device_allocators[i].fixed_device = i;
    c10::SetAllocator(kNpu, &g_current_allocator);
    at::RegisterPrivateUse1HooksInterface(new NpuHooks());
  });
}

// ------------------------------------------------------------------ registration
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_source_storage);
  m.impl("set_", set_empty);
  m.impl("set_.source_Storage", set_source_storage_full);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("convolution_overrideable", convolution_overrideable);
  m.impl("convolution_backward_overrideable", convolution_backward_overrideable);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
  m.impl("native_dropout", native_dropout);
  // Out variants whose composite kernel accepts only CPU/CUDA/XPU tensors: run on the CPU aliases.
  for (const char* name : {"mode.values"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
  // Work is synchronous, so a tensor never needs to be kept alive for another stream.
  m.impl("record_stream", [](at::Tensor&, c10::Stream) {});
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward);
  for (const char* name : {"addbmm", "mv", "addmv", "dot", "vdot",
                           "_addmm_activation"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_matmul_kernel>());
  for (const char* name : {"mm.out", "bmm.out", "addmm.out", "addmm_", "baddbmm.out", "baddbmm_",
                           "addbmm.out", "addbmm_", "mv.out", "addmv.out", "addmv_", "dot.out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_matmul_inplace_kernel>());
}

// The ops a training step calls most (the benchmarks' models: MLPs, CNN, GPT block with AdamW and
// AMP), on the unboxed path; every other op takes the boxed fallback, with the same semantics.
template <class Op, Policy policy>
void impl_unboxed(torch::Library& m) {
  std::string name = std::string(Op::name).substr(6);  // without "aten::"
  if (*Op::overload_name) name += std::string(".") + Op::overload_name;
  m.impl(name.c_str(), TORCH_FN((Unboxed<Op, policy>::kernel)));
}
#define NPU_UNBOXED(op, policy) impl_unboxed<at::_ops::op, Policy::policy>(m)
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  NPU_UNBOXED(add_Tensor, None);
  NPU_UNBOXED(add__Tensor, None);
  NPU_UNBOXED(sub_Tensor, None);
  NPU_UNBOXED(sub__Tensor, None);
  NPU_UNBOXED(mul_Tensor, None);
  NPU_UNBOXED(mul__Tensor, None);
  NPU_UNBOXED(mul_Scalar, None);
  NPU_UNBOXED(mul__Scalar, None);
  NPU_UNBOXED(div_Tensor, None);
  NPU_UNBOXED(div__Tensor, None);
  NPU_UNBOXED(div_Scalar, None);
  NPU_UNBOXED(div__Scalar, None);
  NPU_UNBOXED(div_Tensor_mode, None);
  NPU_UNBOXED(neg, None);
  NPU_UNBOXED(exp, None);
  NPU_UNBOXED(log, None);
  NPU_UNBOXED(sqrt, None);
  NPU_UNBOXED(rsqrt, None);
  NPU_UNBOXED(abs, None);
  NPU_UNBOXED(pow_Tensor_Scalar, None);
  NPU_UNBOXED(sum, None);
  NPU_UNBOXED(sum_dim_IntList, None);
  NPU_UNBOXED(mean, None);
  NPU_UNBOXED(mean_dim, None);
  NPU_UNBOXED(max_dim, None);
  NPU_UNBOXED(amax, None);
  NPU_UNBOXED(argmax, None);
  NPU_UNBOXED(eq_Scalar, None);
  NPU_UNBOXED(eq_Tensor, None);
  NPU_UNBOXED(ne_Scalar, None);
  NPU_UNBOXED(gt_Scalar, None);
  NPU_UNBOXED(lt_Scalar, None);
  NPU_UNBOXED(where_self, None);
  NPU_UNBOXED(masked_fill__Scalar, None);
  NPU_UNBOXED(masked_fill_Scalar, None);
  NPU_UNBOXED(clamp, None);
  NPU_UNBOXED(clamp_, None);
  NPU_UNBOXED(clamp_min, None);
  NPU_UNBOXED(relu, None);
  NPU_UNBOXED(relu_, None);
  NPU_UNBOXED(threshold_backward, None);
  NPU_UNBOXED(gelu, None);
  NPU_UNBOXED(gelu_backward, None);
  NPU_UNBOXED(silu, None);
  NPU_UNBOXED(silu_backward, None);
  NPU_UNBOXED(sigmoid, None);
  NPU_UNBOXED(sigmoid_backward, None);
  NPU_UNBOXED(tanh, None);
  NPU_UNBOXED(tanh_backward, None);
  NPU_UNBOXED(_softmax, None);
  NPU_UNBOXED(_softmax_backward_data, None);
  NPU_UNBOXED(_log_softmax, None);
  NPU_UNBOXED(_log_softmax_backward_data, None);
  NPU_UNBOXED(nll_loss_forward, None);
  NPU_UNBOXED(nll_loss_backward, None);
  NPU_UNBOXED(native_layer_norm, None);
  NPU_UNBOXED(native_layer_norm_backward, None);
  NPU_UNBOXED(native_batch_norm, None);
  NPU_UNBOXED(native_batch_norm_backward, None);
  NPU_UNBOXED(embedding_dense_backward, None);
  NPU_UNBOXED(index_select, None);
  NPU_UNBOXED(cat, None);
  NPU_UNBOXED(fill__Scalar, None);
  NPU_UNBOXED(zero_, None);
  NPU_UNBOXED(clone, None);
  NPU_UNBOXED(_local_scalar_dense, None);
  NPU_UNBOXED(addcmul_, None);
  NPU_UNBOXED(addcdiv_, None);
  NPU_UNBOXED(lerp__Scalar, None);
  NPU_UNBOXED(_foreach_add__List, None);
  NPU_UNBOXED(_foreach_add__Scalar, None);
  NPU_UNBOXED(_foreach_add__ScalarList, None);
  NPU_UNBOXED(_foreach_add__Tensor, None);
  NPU_UNBOXED(_foreach_mul__Scalar, None);
  NPU_UNBOXED(_foreach_mul__List, None);
  NPU_UNBOXED(_foreach_mul__Tensor, None);
  NPU_UNBOXED(_foreach_div__Scalar, None);
  NPU_UNBOXED(_foreach_div__List, None);
  NPU_UNBOXED(_foreach_div__ScalarList, None);
  NPU_UNBOXED(_foreach_addcmul__Scalar, None);
  NPU_UNBOXED(_foreach_addcmul__ScalarList, None);
  NPU_UNBOXED(_foreach_addcdiv__Scalar, None);
  NPU_UNBOXED(_foreach_addcdiv__ScalarList, None);
  NPU_UNBOXED(_foreach_lerp__Scalar, None);
  NPU_UNBOXED(_foreach_sqrt, None);
  NPU_UNBOXED(_foreach_sqrt_, None);
  NPU_UNBOXED(_foreach_neg, None);
  NPU_UNBOXED(_foreach_neg_, None);
  NPU_UNBOXED(_foreach_maximum__List, None);
  NPU_UNBOXED(_foreach_norm_Scalar, None);
  NPU_UNBOXED(_foreach_sub__List, None);
  NPU_UNBOXED(_foreach_sub__Scalar, None);
  NPU_UNBOXED(mm, Matmul);
  NPU_UNBOXED(addmm, Matmul);
  NPU_UNBOXED(bmm, Matmul);
  NPU_UNBOXED(baddbmm, Matmul);
}
#undef NPU_UNBOXED

// Our _copy_from resolves conj/neg bits itself (on the CPU aliases); without these
// fallthroughs the math-bit fallbacks materialise through clone -> copy_ -> _copy_from forever.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

// ------------------------------------------------------------------ autocast
// torch.autocast("npu") uses the CUDA autocast op lists and cast policies, as torch_npu does.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using at::Scalar;
  using at::ScalarType;
  using at::Tensor;
  using c10::IntArrayRef;
#define NPU_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(NPU_LOW_PRECISION_FP)
#define NPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(NPU_FP32)
#define NPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(NPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define NPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(NPU_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN((&binary_cross_entropy_banned)));
}

}  // namespace npukit

// ------------------------------------------------------------------ python bindings
namespace {
using namespace npukit;

void check_py_index(int idx) {
  TORCH_CHECK_INDEX(idx >= 0 && idx < g_device_count.load(), "Invalid device id: npu:", idx,
                    " (device count is ", g_device_count.load(), ")");
}

py::dict memory_stats(int dev) {
  check_py_index(dev);
  struct {
    int64_t allocated, peak, blocks, peak_blocks, num_allocs, num_frees, num_ooms;
  } m;  // one consistent snapshot, copied under the lock
  {
    auto& live = g_memory[dev];
    std::lock_guard<SpinLock> lock(live.mu);
    m = {live.allocated, live.peak, live.blocks, live.peak_blocks, live.num_allocs, live.num_frees, live.num_ooms};
  }
  py::dict d;
  for (const char* pool : {"all", "large_pool", "small_pool"}) {
    bool all = std::string(pool) == "all";
    for (const char* kind : {"allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"}) {
      std::string base = std::string(kind) + "." + pool + ".";
      d[py::str(base + "current")] = all ? m.allocated : 0;
      d[py::str(base + "peak")] = all ? m.peak : 0;
      d[py::str(base + "allocated")] = all ? m.num_allocs : 0;
      d[py::str(base + "freed")] = all ? m.num_frees : 0;
    }
    for (const char* kind : {"allocation", "segment", "active"}) {
      std::string base = std::string(kind) + "." + pool + ".";
      d[py::str(base + "current")] = all ? m.blocks : 0;
      d[py::str(base + "peak")] = all ? m.peak_blocks : 0;
      d[py::str(base + "allocated")] = all ? m.num_allocs : 0;
      d[py::str(base + "freed")] = all ? m.num_frees : 0;
    }
  }
  d["num_alloc_retries"] = 0;
  d["num_ooms"] = m.num_ooms;
  d["num_device_alloc"] = m.num_allocs;
  d["num_device_free"] = m.num_frees;
  return d;
}
}  // namespace

namespace npukit {
// tensor_types.cpp: torch.npu.FloatTensor, torch.npu.HalfTensor, ...
py::list legacy_tensor_types();
namespace fused {
void bind(py::module& m);  // fused_kernels.cpp: the fused ops' kernels
}
}  // namespace npukit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("install", &install);
  npukit::fused::bind(mod);
  mod.def("route_composite_ops_to_cpu_kernels", &route_composite_ops_to_cpu_kernels);
  mod.def("set_device_count", [](int n) {
    TORCH_CHECK(n >= 0 && n <= kMaxDevices, "device count must be in [0, ", kMaxDevices, "], got ", n);
    g_device_count = n;
  });
  mod.def("device_count", [] { return g_device_count.load(); });
  mod.def("current_device", [] { return int(t_current_device); });
  mod.def("set_device", [](int idx) {
    check_py_index(idx);
    t_current_device = c10::DeviceIndex(idx);
  });
  mod.def("memory_allocated", [](int dev) {
    check_py_index(dev);
    std::lock_guard<SpinLock> lock(g_memory[dev].mu);
    return g_memory[dev].allocated;
  });
  mod.def("max_memory_allocated", [](int dev) {
    check_py_index(dev);
    std::lock_guard<SpinLock> lock(g_memory[dev].mu);
    return g_memory[dev].peak;
  });
  mod.def("reset_peak_memory_stats", [](int dev) {
    check_py_index(dev);
    std::lock_guard<SpinLock> lock(g_memory[dev].mu);
    g_memory[dev].peak = g_memory[dev].allocated;
    g_memory[dev].peak_blocks = g_memory[dev].blocks;
  });
  mod.def("memory_stats", &memory_stats);
  mod.def("set_capacity", [](int dev, int64_t bytes) {
    TORCH_CHECK(bytes > 0, "NPU memory capacity must be positive, got ", bytes);
    std::lock_guard<SpinLock> lock(g_memory[dev].mu);
    g_memory[dev].capacity = bytes;
  });
  mod.def("capacity", [](int dev) {
    std::lock_guard<SpinLock> lock(g_memory[dev].mu);
    return g_memory[dev].capacity;
  });
  mod.def("default_generator", [](int idx) {
    check_py_index(idx);
    return default_generator(c10::DeviceIndex(idx));
  });
  mod.def("_generator_full_state", [](int idx) {
    check_py_index(idx);
    return static_cast<NpuGeneratorImpl*>(default_generator(c10::DeviceIndex(idx)).unsafeGetGeneratorImpl())
        ->full_state();
  });
  mod.def("_set_generator_full_state", [](int idx, const at::Tensor& state) {
    check_py_index(idx);
    static_cast<NpuGeneratorImpl*>(default_generator(c10::DeviceIndex(idx)).unsafeGetGeneratorImpl())
        ->set_full_state(state);
  });
  mod.def("is_pinned_ptr", [](uintptr_t p) {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    return g_pinned.count(reinterpret_cast<const void*>(p)) > 0;
  });
  // Numeric policies.
  mod.def("set_saturation", [](bool on) { g_saturation = on; });
  mod.def("get_saturation", [] { return g_saturation.load(); });
  mod.def("get_overflow_flag", [] { return g_overflow_flag.load(); });
  mod.def("set_overflow_flag", [](bool on) { g_overflow_flag = on; });
  mod.def("set_fp32_accumulate", [](bool on) { g_fp32_accumulate = on; });
  mod.def("get_fp32_accumulate", [] { return g_fp32_accumulate.load(); });
  mod.def("set_matmul_hf32", [](bool on) { g_matmul_hf32 = on; });
  mod.def("get_matmul_hf32", [] { return g_matmul_hf32.load(); });
  mod.def("set_conv_hf32", [](bool on) { g_conv_hf32 = on; });
  mod.def("get_conv_hf32", [] { return g_conv_hf32.load(); });
  mod.def("set_reject_fp64", [](bool on) { g_reject_fp64 = on; });
  mod.def("get_reject_fp64", [] { return g_reject_fp64.load(); });
  mod.def("set_check_devices", [](bool on) { g_check_devices = on; });
  mod.def("round_to_hf32", [](const at::Tensor& t) { return round_to_hf32(t); });
  mod.def("legacy_tensor_types", &npukit::legacy_tensor_types);
}


// scaled_dot_product_attention on npu takes the kernel the CPU takes for the same tensors (its flash
// attention kernel wherever that applies: scores and exp(S - max) in fp32, P read in the input dtype
// by the second matmul, the fp32 sums divided by the row sum at the end, as Ascend's flash kernel
// computes), not the math decomposition, which rounds the softmax's output and costs a third more
// (a tiny Llama training step 1.17-1.18x the CPU's on the math path, 1.07-1.10x so). With dropout the
// math path stays: its mask comes from the npu generator, where the CPU kernel would draw from the
// CPU's.
namespace {
int64_t npu_fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa) {
  if (dropout_p > 0) return static_cast<int64_t>(at::SDPBackend::math);
  // The CPU's fp16 flash kernel multiplies fp16 blocks with scalar code where the CPU has no fp16
  // matrix unit (AMX-FP16): 2x the math path's time. npu's fp16 math path (npu_sdpa_math) rounds P
  // as the flash kernels do.
  if (query.scalar_type() == at::kHalf && !at::native::cpublas::could_pack(at::kHalf)) {
    return static_cast<int64_t>(at::SDPBackend::math);
  }
  // The CPU's choice reads only the tensors' metadata (shapes, strides, dtypes, requires_grad), so it
  // is made on the npu tensors themselves: also on FakeTensors, so torch.compile picks the same kernel.
  return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}
}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &npu_fused_sdp_choice)
}  // namespace at::native

// The math path of F.scaled_dot_product_attention on npu. In fp16 without dropout (taken where the CPU
// has no AMX-FP16, above) it computes as the CPU's math path does (fp32 scores, the safe softmax in
// fp32, fp32 accumulation, one rounding at the end) and also rounds P to fp16 before P @ V, as
// Ascend's flash kernel (and the CPU's) does. The rounding is straight-through for the gradient: dP
// stays fp32 as the flash kernels keep it (an fp16 dP could overflow where the NPU's does not).
// Anything else is the CPU's math path as it is.
namespace {
struct RoundToHalfStraightThrough : public torch::autograd::Function<RoundToHalfStraightThrough> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& probs) {
    return probs.to(at::kHalf).to(at::kFloat);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0]};
  }
};

at::Tensor additive_mask(const at::Tensor& mask) {
  if (mask.scalar_type() != at::kBool) return mask;
  return at::zeros(mask.sizes(), mask.options().dtype(at::kFloat))
      .masked_fill_(mask.logical_not(), -std::numeric_limits<float>::infinity());
}

std::tuple<at::Tensor, at::Tensor> npu_sdpa_math(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                 double dropout_p, bool is_causal,
                                                 const std::optional<at::Tensor>& dropout_mask,
                                                 std::optional<double> scale, bool enable_gqa) {
  if (query.scalar_type() != at::kHalf || dropout_p > 0 || dropout_mask.has_value() || query.is_nested() ||
      key.is_nested() || value.is_nested()) {
    return at::native::_scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                          dropout_mask, scale, enable_gqa);
  }
  const bool negative_scale = scale.has_value() && scale.value() < 0.0;
  const auto factor = sdp::calculate_scale(query, negative_scale ? std::abs(scale.value()) : scale).sqrt();
  const auto query_acc = query.to(at::kFloat) * (negative_scale ? c10::SymFloat(0.0) - factor : factor);
  auto key_acc = key.to(at::kFloat);
  auto value_acc = value.to(at::kFloat);
  if (enable_gqa && key.sym_size(-3) != query.sym_size(-3)) {
    const auto repeats = query.sym_size(-3) / key.sym_size(-3);
    key_acc = key_acc.repeat_interleave_symint(repeats, -3);
    value_acc = value_acc.repeat_interleave_symint(repeats, -3);
  }
  auto scores = at::matmul(query_acc, key_acc.transpose(-2, -1) * factor);
  std::optional<at::Tensor> mask;
  if (is_causal) {
    TORCH_CHECK(!attn_mask.has_value(),
                "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True");
    mask = additive_mask(
        at::ones_symint({query.sym_size(-2), key.sym_size(-2)}, query.options().dtype(at::kBool)).tril());
  } else if (attn_mask.has_value()) {
    mask = additive_mask(*attn_mask);
  }
  if (mask.has_value()) {
    // in place, as the CPU's math path adds it (no second buffer of the scores' size)
    scores = at::areAnyTensorSubclassLike({scores, *mask}) ? scores.add(*mask) : scores.add_(*mask);
  }
  const auto rounded = RoundToHalfStraightThrough::apply(at::_safe_softmax(scores, -1));
  return std::make_tuple(at::matmul(rounded, value_acc).to(at::kHalf), rounded.to(at::kHalf));
}
}  // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_scaled_dot_product_attention_math", &npu_sdpa_math);
}
