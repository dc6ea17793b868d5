#pragma once
// ExternalReads: the tensors one checkpoint region invocation reads from outside itself,
// for the C++ interception path of selective checkpoint (OpInterceptor.h). The same
// record as the Python layer's ExternalTensors (src/.../_external.py; docs/design.md,
// "Recompute and state outside the region"), kept per op without a Python call:
//
//   * forward: a tensor input that no earlier op of the region produced is external; its
//     version is noted at the first read (a weak reference, no copy). Right before an op
//     writes an external tensor (or a view of one) its value is copied (copy on write:
//     only written state costs memory, e.g. BatchNorm's running statistics). Every
//     external tensor sharing the written one's storage is copied, not only the one
//     written or its base: a view read elsewhere (`v = buf[:4]` read, `buf[4:]` written;
//     FSDP2's all-gather input, a view of the buffer the collective writes) keeps the
//     value forward read whatever the write touched. When such a write changed its
//     value (it overlaps), reads after it saw the new value: end_forward() finds it
//     changed and the recompute raises instead of using the copy;
//   * recompute: reads of a written external tensor are redirected to a private copy of
//     the value forward read (the recompute's writes go there and are dropped); reads of
//     any other external tensor check that its version is still the one forward saw, and
//     raise otherwise (backward would compute from a different value).
//
// Tensors are identified by their TensorImpl (a Python tensor object and its TensorImpl
// are one to one), guarded by a weak reference against address reuse.
//
// Errors: c10::Error ("hyper_parallel: ...", RuntimeError in Python); `describe(t)` (may
// be empty) names a tensor in them (e.g. "buffer 'bn.running_mean'").
//
// Thread-safety: none; one invocation is used by one thread at a time (its forward, then
// the thread that recomputes it). Helper copies (clone) are made by the caller's thread
// and must run with the interception key excluded (OpInterceptor does).

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hyper_parallel::activation {

class ExternalReads {
 public:
  using Describe = std::function<std::string(const at::Tensor&)>;
  explicit ExternalReads(Describe describe = nullptr) : describe_(std::move(describe)) {}

  // --- forward ------------------------------------------------------------------------
  // Before op `op_key` (OpNames) runs with arguments `args` (boxed, schema order): notes
  // external inputs and copies each external tensor that the arguments at schema positions
  // `writes` are about to write.
  // `declared`: the positions of `writes` the op's schema declares (Tensor(a!): autograd
  // bumps the version), not the batch norms' writes of their running statistics.
  // `op`: the operator's identity (its schema's address; the caller adds 1 when grad
  // mode is off, see OpInterceptor.cpp), for following where the recompute goes another
  // way (follow()).
  // `view`: the op returns a view of its first argument (it reads no value).
  void forward_inputs(int64_t op_key, const void* op, c10::ArrayRef<c10::IValue> args,
                      const std::vector<int>& writes, const std::vector<int>& declared,
                      bool view = false);
  // After the op ran: its outputs are the region's own tensors. `source`: for a view op,
  // the argument they view (or alias: detach). A view the region made of an external
  // tensor, directly or through such views, counts as that tensor for a write (its
  // recompute makes the view again from the tensor's copy, so the write is replayed
  // there): nn.Embedding(max_norm=...) renormalizes weight.detach() in place.
  void forward_outputs(c10::ArrayRef<c10::IValue> outputs, const at::Tensor* source = nullptr);
  // The forward is over. An external tensor whose version moved although no op declared a
  // write to it was written by an op that does not say so (its value is unknown).
  void end_forward();
  // External tensors the forward wrote (a copy of each is kept).
  int64_t written() const;

  // --- recompute ----------------------------------------------------------------------
  // Starts a recompute pass. Throws when an external tensor forward read and did not write
  // was modified since, or when one was written by an undeclared write.
  void begin_recompute();
  // Rewrites the `n` arguments at the end of `stack` in place: written external tensors
  // become this pass's private copy of the value forward read. Throws when an external
  // tensor was modified after forward read it, or when its value was not kept. A private
  // copy at a position of `writes` (the op writes it) has its version bumped, as autograd
  // bumps the tensor it sees (the real one, above the redirection): a value saved from
  // the copy before this write then shows the write (recompute_save's `watch`).
  // `op` as for forward_inputs(). Where the recompute's accesses of a tensor the forward
  // changed stop matching the forward's (its control flow depends on state outside
  // tensors: a Python flag set by the call that initialized the tensor, a lazy module
  // materialized in its first forward), the access is matched to the forward's later ones
  // by the same op; when they all saw one value (no write between them), the copy takes
  // it, in place (kept before each write, Read::steps, or the value the forward left, as
  // torch's checkpoint reads it); otherwise it throws (which value is meant cannot be
  // told, or it was not kept).
  void recompute_args(int64_t op_key, const void* op, std::vector<c10::IValue>& stack,
                      size_t n, const std::vector<int>& writes = {});

  // Recompute: what autograd must save in place of `t`, which an op of the recompute is
  // about to save for backward (called from a saved-tensor pack hook, before the op runs),
  // and whether the saved tensor shares memory with a private copy. Autograd saves an op's
  // arguments above the dispatch level at which reads are redirected, so a written external
  // tensor would be saved as itself, holding the value the whole forward left (the
  // gradient then reads that, not the value the op read): the private copy is saved
  // instead. `watch` is true when the tensor saved is, or views, a private copy: a later
  // write of the recompute to that copy would change a saved value (plain autograd's
  // version error); the caller compares its version when the recompute ends.
  struct Save {
    at::Tensor tensor;
    bool watch = false;
  };
  Save recompute_save(const at::Tensor& t);
  // The external tensors the forward wrote whose value was kept (the ones with a private
  // copy in recompute). A recompute writes only their copies, but a write through a view
  // the recompute made bumps the real tensor's version (autograd's view tracking sits
  // above the redirection); the caller puts their versions back when it ends.
  std::vector<at::Tensor> written_tensors() const;

  size_t reads() const { return reads_.size(); }
  // Whether the forward read `t`'s value (an op took it, a view the region made of it, or
  // another tensor of its storage such as `t.data`, as an argument whose value it reads:
  // not only a view op, not only a declared write). Asked after the forward, of a
  // module's buffer the forward replaced by another tensor, which lived through the whole
  // forward: was the old one read? (docs/design.md, "Recompute and state outside the
  // region").
  bool read_in_forward(const at::Tensor& t);

 private:
  // kOverlapped: kept when a write through another tensor of its storage (not itself, not
  // its view) came, and that write changed its value during the forward: reads after the
  // write saw the new value, which the copy does not hold.
  enum class Snap : uint8_t { kNone, kValue, kLost, kUndeclared, kOverlapped };
  struct Read {
    explicit Read(const at::Tensor& t)
        : ref(t.getIntrusivePtr()),
          storage(t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr) {}
    c10::weak_intrusive_ptr<c10::TensorImpl> ref;
    // Its storage when read (compared before `ref` is locked; checked again through it).
    const c10::StorageImpl* storage = nullptr;
    uint32_t version = 0;
    Snap snap = Snap::kNone;
    at::Tensor snapshot;  // kValue: the value forward read, kept before its first write
    bool by_other = false;  // kept for a write through another tensor of its storage
    // Written by an op that declares the write, not only by the batch norms' undeclared
    // writes of their running statistics (recompute_save() saves those as themselves).
    bool declared = false;
    int64_t op_key = -1;  // the op that read it first
    // The operators that took it as an argument, in forward order (its accesses; an op
    // run with grad mode off counts as another operator: forward_inputs()); those from
    // index `settled` on saw the value the forward left (no write of any kind after
    // them). `writes`: writes of any kind (a storage replaced, `.data = ...`, included).
    std::vector<const void*> ops;
    size_t settled = 0;
    int64_t writes = 0;
    uint32_t end_version = 0;  // its version when the forward ended
    // The index of its first and last access that read its value (not a view op, not a
    // declared write of it; through a view the region made of it: the next index), -1:
    // none.
    int64_t first_read = -1;
    int64_t last_read = -1;
    // Per write of the forward, (b, value before it): accesses before index b saw that
    // value (at most kMaxSteps; then an undefined tensor: not kept).
    std::vector<std::pair<size_t, at::Tensor>> steps;
  };
  static constexpr size_t kMaxSteps = 8;
  static constexpr size_t kMaxStepBytes = size_t{1} << 20;  // (past the first step)

  // Notes an access of `t` (a first one makes its record); its record, or nullptr for a
  // tensor the region produced.
  Read* note(const at::Tensor& t, int64_t op_key, const void* op);
  // A later access of an external tensor (a storage replaced since is followed).
  void again(Read& rec, const c10::TensorImpl* impl, const at::Tensor& t, const void* op);
  // Recompute: whether this access of `t` (written by the forward) reads the copy holding
  // the value the forward left; see recompute_args().
  bool follow(Read& rec, const at::Tensor& t, int64_t op_key, const void* op);
  // Recompute, from the pack hook (before the op reaches follow(), and maybe the last op
  // before early stop): whether `t`, not accessed yet in this pass, is saved where the
  // forward first wrote it (the recompute skipped those writes), and the copy then holds
  // the value the forward left.
  bool skipped_to_save(Read& rec, const at::Tensor& t);
  // The value the forward's access `j` of `rec` saw: a kept one (undefined: not kept), or
  // nullptr for the value the forward left.
  static const at::Tensor* value_at(const Read& rec, size_t j);
  // Puts that value in `t`'s private copy (in place when it has one), unless `pos` (the
  // access the recompute was at) saw the same one; throws where it was not kept or `t`
  // changed since the forward. Returns true.
  bool take(Read& rec, const at::Tensor& t, const std::string& op, size_t j,
            std::optional<size_t> pos);
  std::string ambiguous_message(const at::Tensor& t, const std::string& op) const;
  void before_write(const at::Tensor& t, bool declared);
  Read* find(const at::Tensor& t);
  // `t` as the recompute must read it (itself, or the private copy); throws as documented.
  at::Tensor resolve(const at::Tensor& t, int64_t op_key, const void* op);
  // recompute_args() without the version bumps.
  void resolve_args(int64_t op_key, const void* op, std::vector<c10::IValue>& stack, size_t n);
  std::string name(const at::Tensor& t) const;
  std::string modified_message(const at::Tensor& t, int64_t op_key, uint32_t version) const;
  std::string overlapped_message(const at::Tensor& t) const;

  Describe describe_;
  std::unordered_map<const c10::TensorImpl*, Read> reads_;
  // The reads of each storage (before_write() looks up the written one instead of
  // scanning every read: a region reading thousands of outside tensors and writing its
  // own temporaries in place paid reads x writes).
  std::unordered_map<const c10::StorageImpl*, std::vector<const c10::TensorImpl*>> by_storage_;
  // The region's own tensors (forward only). Each held by a weak reference: a
  // TensorImpl's memory outlives its last strong reference while a weak one is held, so no
  // tensor made later in the forward takes a dead one's address (a buffer's `.data`, a new
  // object over outside memory made without an op, had been taken for the region's own:
  // its reads were not seen; tester, session 20). Records hold theirs (Read::ref) alike.
  std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> produced_;
  // Views the region made of external tensors -> the external tensor (forward only).
  std::unordered_map<const c10::TensorImpl*, const c10::TensorImpl*> alias_of_;
  bool forward_over_ = false;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> shadows_;
  // Recompute, per pass: the index of the next forward access of each tensor the forward
  // changed (follow()).
  std::unordered_map<const c10::TensorImpl*, size_t> cursor_;
};

}  // namespace hyper_parallel::activation
