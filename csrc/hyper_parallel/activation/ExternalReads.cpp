#include "hyper_parallel/activation/ExternalReads.h"

#include <torch/csrc/autograd/variable.h>

#include "hyper_parallel/activation/OpPolicyTable.h"
#include "hyper_parallel/common/Macros.h"

#include <ATen/ops/view_as_real.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>

namespace hyper_parallel::activation {

namespace {

// Calls f(tensor) for the tensors of one boxed argument: Tensor, Tensor?, Tensor[],
// Tensor?[] (one level, as op arguments hold them).
template <class F>
void for_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) f(t);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined()) f(t);
    }
  } else if (v.isList()) {
    for (const c10::IValue& u : v.toListRef()) {
      if (u.isTensor() && u.toTensor().defined()) f(u.toTensor());
    }
  }
}

// A detached copy of `t`'s value that records no autograd history.
at::Tensor copy_of(const at::Tensor& t) {
  c10::AutoGradMode no_grad(false);
  return t.detach().clone();
}

// Whether two tensors of one shape and dtype hold the same bytes (NaNs included, which
// Tensor::equal calls unequal).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().reshape({-1}).contiguous();
  at::Tensor y = b.detach().reshape({-1}).contiguous();
  if (x.is_complex()) {
    x = at::view_as_real(x);
    y = at::view_as_real(y);
  }
  if (x.scalar_type() == at::kBool) return x.equal(y);
  return x.view(at::kByte).equal(y.view(at::kByte));
}

}  // namespace

ExternalReads::Read* ExternalReads::find(const at::Tensor& t) {
  auto it = reads_.find(t.unsafeGetTensorImpl());
  if (it == reads_.end()) return nullptr;
  // The address may belong to a new tensor now: the record is for the one it referred to.
  if (it->second.ref.expired() || it->second.ref._unsafe_get_target() != t.unsafeGetTensorImpl()) {
    return nullptr;
  }
  return &it->second;
}

bool ExternalReads::read_in_forward(const at::Tensor& t) {
  if (const Read* rec = find(t); rec != nullptr && rec->first_read >= 0) return true;
  if (!t.has_storage()) return false;
  // Through another tensor of its storage: `t.data`, `t.detach()` made outside the
  // interception (a new tensor object each, gone since: their records stay). `t` lived
  // through the whole forward, so no other storage had its address meanwhile.
  const auto holders = by_storage_.find(t.storage().unsafeGetStorageImpl());
  if (holders == by_storage_.end()) return false;
  for (const c10::TensorImpl* impl : holders->second) {
    const auto it = reads_.find(impl);
    if (it != reads_.end() && it->second.first_read >= 0) return true;
  }
  return false;
}

ExternalReads::Read* ExternalReads::note(const at::Tensor& t, int64_t op_key, const void* op) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto it = reads_.find(impl);
  if (it != reads_.end() && !it->second.ref.expired()) {
    // (an in-place op's output is the tensor itself, in produced_ since: it is still one
    // of the region's external tensors)
    if (it->second.ref._unsafe_get_target() != impl) return nullptr;
    again(it->second, impl, t, op);
    return &it->second;
  }
  if (produced_.count(impl)) return nullptr;
  Read r(t);
  r.version = t._version();
  r.op_key = op_key;
  r.ops.push_back(op);
  if (r.storage != nullptr) by_storage_[r.storage].push_back(impl);
  return &reads_.insert_or_assign(impl, std::move(r)).first->second;
}

void ExternalReads::again(Read& rec, const c10::TensorImpl* impl, const at::Tensor& t,
                          const void* op) {
  const c10::StorageImpl* storage = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  if (storage != rec.storage) {
    // Its storage was replaced in the forward (`p.data = ...`, a lazy module's
    // materialization): no op did it, so the index moves with it (a write, with no value
    // kept from before it; accesses from before it read the tensor as it is in recompute).
    if (auto old = by_storage_.find(rec.storage); old != by_storage_.end()) {
      auto& v = old->second;
      v.erase(std::remove(v.begin(), v.end(), impl), v.end());
    }
    rec.storage = storage;
    if (storage != nullptr) by_storage_[storage].push_back(impl);
    rec.settled = rec.ops.size();
    ++rec.writes;
  }
  rec.ops.push_back(op);
}

void ExternalReads::forward_inputs(int64_t op_key, const void* op,
                                   c10::ArrayRef<c10::IValue> args,
                                   const std::vector<int>& writes,
                                   const std::vector<int>& declared, bool view) {
  if (forward_over_) return;
  // The index of each external tensor's first and last access that reads its value: not
  // a view op, not an argument the op declares it writes (the batch norms' undeclared
  // writes of their running statistics read them too, and write nothing in eval mode);
  // through a view the region made of it too. One pass with the accesses.
  c10::SmallVector<const c10::TensorImpl*, 4> written;
  if (!view) {
    for (int i : declared) {
      if (i >= 0 && static_cast<size_t>(i) < args.size()) {
        for_tensors(args[static_cast<size_t>(i)],
                    [&](const at::Tensor& t) { written.push_back(t.unsafeGetTensorImpl()); });
      }
    }
  }
  for (const auto& v : args) {
    for_tensors(v, [&](const at::Tensor& t) {
      Read* rec = note(t, op_key, op);
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (view || std::find(written.begin(), written.end(), impl) != written.end()) return;
      if (rec != nullptr) {
        rec->last_read = static_cast<int64_t>(rec->ops.size()) - 1;  // (this access)
        if (rec->first_read < 0) rec->first_read = rec->last_read;
        return;
      }
      if (alias_of_.empty()) return;
      const auto alias = alias_of_.find(impl);
      if (alias == alias_of_.end()) return;
      const auto it = reads_.find(alias->second);
      if (it != reads_.end()) {
        Read& root = it->second;
        root.last_read = static_cast<int64_t>(root.ops.size());  // (the next index)
        if (root.first_read < 0) root.first_read = root.last_read;
      }
    });
  }
  for (int i : writes) {
    if (i >= 0 && static_cast<size_t>(i) < args.size()) {
      const bool is_declared = std::find(declared.begin(), declared.end(), i) != declared.end();
      for_tensors(args[i], [&](const at::Tensor& t) { before_write(t, is_declared); });
    }
  }
}

void ExternalReads::before_write(const at::Tensor& t, bool declared) {
  // Every external tensor in the written storage: the one written, its base, other views
  // of that base (their values forward read are kept, whatever part the write touches).
  if (!t.has_storage()) return;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const auto holders = by_storage_.find(storage);
  if (holders == by_storage_.end()) return;
  for (const c10::TensorImpl* impl : holders->second) {
    const auto it = reads_.find(impl);
    if (it == reads_.end()) continue;
    Read& rec = it->second;
    if (rec.storage != storage) continue;
    if (declared) rec.declared = true;
    // (accesses from the next one on see the value after this write; the current op's
    // access, when it is one of the tensor's, was noted before)
    rec.settled = rec.ops.size();
    ++rec.writes;
    auto p = rec.ref.lock();
    if (!p) continue;
    const at::Tensor u(std::move(p));
    if (!u.has_storage() || u.storage().unsafeGetStorageImpl() != storage) continue;
    // The value before each write (Read::steps), for a recompute that goes another way.
    // (the first is the copy the replay needs anyway; later ones cost memory held until
    // backward whether or not the recompute goes another way: small state only)
    if (rec.steps.empty() ||
        (rec.steps.back().first != rec.settled && rec.steps.back().second.defined())) {
      const bool keep = rec.steps.empty() ||
                        (rec.steps.size() < kMaxSteps && u.nbytes() <= kMaxStepBytes);
      rec.steps.emplace_back(rec.settled, keep ? copy_of(u) : at::Tensor());
    }
    if (rec.snap != Snap::kNone && rec.snap != Snap::kValue) continue;
    // Through itself, or a view or alias of it the region made (the recompute makes it
    // again from u's copy), the recompute replays the write on u's copy; through another
    // tensor (its base, a view made outside) it does not: end_forward() checks the value.
    // Every write counts, not only the first (tester, session 18: a second write through
    // an outside view was lost from the copy, a silently wrong gradient).
    const c10::TensorImpl* ti = t.unsafeGetTensorImpl();
    const auto alias = alias_of_.find(ti);
    const bool other = !u.is_same(t) &&
                       !(produced_.count(ti) > 0 &&
                         ((t.is_view() && t._base().is_same(u)) ||
                          (alias != alias_of_.end() && alias->second == impl)));
    if (rec.snap == Snap::kValue) {
      rec.by_other = rec.by_other || other;
    } else if (u._version() == rec.version) {
      const auto& first = rec.steps.front();
      rec.snapshot = first.first == rec.settled && first.second.defined() ? first.second
                                                                           : copy_of(u);
      rec.snap = Snap::kValue;
      rec.by_other = other;
    } else {
      rec.snap = Snap::kLost;  // written before, by an op that did not declare it
    }
  }
}

void ExternalReads::forward_outputs(c10::ArrayRef<c10::IValue> outputs,
                                    const at::Tensor* source) {
  if (forward_over_) return;
  const c10::TensorImpl* root = nullptr;
  if (source != nullptr && source->defined()) {
    const c10::TensorImpl* s = source->unsafeGetTensorImpl();
    if (find(*source) != nullptr) {
      root = s;
    } else if (const auto it = alias_of_.find(s); it != alias_of_.end()) {
      root = it->second;
    }
  }
  for (const auto& v : outputs) {
    for_tensors(v, [&](const at::Tensor& t) {
      produced_.try_emplace(t.unsafeGetTensorImpl(), t.getIntrusivePtr());
      if (root != nullptr) alias_of_[t.unsafeGetTensorImpl()] = root;
    });
  }
}

void ExternalReads::end_forward() {
  forward_over_ = true;
  produced_.clear();  // only needed to tell external tensors apart
  produced_.rehash(0);
  alias_of_.clear();
  for (auto& [impl, rec] : reads_) {
    if (auto p = rec.ref.lock()) rec.end_version = p->version_counter().current_version();
    if (rec.snap == Snap::kValue && rec.by_other) {
      auto p = rec.ref.lock();
      if (p && !same_bits(at::Tensor(std::move(p)), rec.snapshot)) {
        rec.snap = Snap::kOverlapped;
        rec.snapshot = at::Tensor();
      }
      continue;
    }
    if (rec.snap != Snap::kNone) continue;
    auto t = rec.ref.lock();
    if (t && t->version_counter().current_version() != rec.version) rec.snap = Snap::kUndeclared;
  }
}

int64_t ExternalReads::written() const {
  int64_t n = 0;
  for (const auto& [impl, rec] : reads_) n += rec.snap != Snap::kNone;
  return n;
}

std::string ExternalReads::name(const at::Tensor& t) const {
  if (describe_) return describe_(t);
  std::ostringstream os;
  os << "a tensor from outside the region (shape " << t.sizes() << ", " << t.scalar_type()
     << ")";
  return os.str();
}

namespace {
// The op that read a tensor first, for messages: ops never cached (views, in-place ops)
// have no interned key (-1).
std::string op_label(int64_t op_key) {
  return op_key >= 0 ? OpNames::name(op_key) : std::string("a view or in-place op");
}
}  // namespace

std::string ExternalReads::modified_message(const at::Tensor& t, int64_t op_key,
                                            uint32_t version) const {
  std::ostringstream os;
  os << "the recompute of a checkpoint region reads " << name(t) << " (in "
     << op_label(op_key) << "), which was modified in place after the region's forward "
     << "read it (version " << version << " -> " << t._version() << "). Backward would "
     << "compute its gradients from a different value than forward used. Modify it after "
     << "backward (or before the forward), or clone it and let the region read the clone.";
  return os.str();
}

std::string ExternalReads::overlapped_message(const at::Tensor& t) const {
  return "the recompute of a checkpoint region reads " + name(t) + ", whose value the "
         "region's forward changed after reading it by writing another tensor of the same "
         "memory (its base or another view of it): the recompute cannot replay that. Write "
         "through the tensor the region reads (or a view of it), clone it before the region "
         "reads it, or move the write out of the checkpointed function.";
}

void ExternalReads::begin_recompute() {
  shadows_.clear();
  cursor_.clear();
  for (auto& [impl, rec] : reads_) {
    if (rec.snap == Snap::kValue || rec.snap == Snap::kLost) continue;
    auto p = rec.ref.lock();
    if (!p) continue;
    const at::Tensor t(std::move(p));
    if (rec.snap == Snap::kNone) {
      HP_CHECK(t._version() == rec.version, modified_message(t, rec.op_key, rec.version));
    } else if (rec.snap == Snap::kOverlapped) {
      HP_CHECK(false, overlapped_message(t));
    } else {
      HP_CHECK(false, "the recompute of a checkpoint region needs the value that ", name(t),
               " had when ", op_label(rec.op_key), " read it in the region's forward, "
               "but an op of that forward modified it without declaring the write in its "
               "schema (e.g. a custom kernel), so the value was not kept (version ",
               rec.version, " -> ", t._version(), "). Declare the write in the op's schema "
               "(Tensor(a!)), or move that update out of the checkpointed function.");
    }
  }
}

std::string ExternalReads::ambiguous_message(const at::Tensor& t, const std::string& op) const {
  return "the recompute of a checkpoint region took another path than its forward and reads " +
         name(t) + " (in " + op + ") where the forward read it at several points with "
         "different values in between (it modified it), so which value this read needs "
         "cannot be told. The region's control flow depends on state outside its tensors (a "
         "Python flag changed by its first call?): keep that state the same for the "
         "recompute, run the first call outside checkpoint, or move the writes out of the "
         "checkpointed function.";
}

const at::Tensor* ExternalReads::value_at(const Read& rec, size_t j) {
  static const at::Tensor kLost;  // (undefined: a write after the last value kept)
  if (j >= rec.settled) return nullptr;  // (after the forward's last write)
  for (const auto& step : rec.steps) {
    if (j < step.first) return &step.second;
  }
  return &kLost;
}

bool ExternalReads::take(Read& rec, const at::Tensor& t, const std::string& op, size_t j,
                         std::optional<size_t> pos) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const at::Tensor* value = value_at(rec, j);
  if (pos && shadows_.count(impl) && value == value_at(rec, *pos)) {
    return true;  // (the skipped accesses wrote nothing: the copy holds it already)
  }
  HP_CHECK(value == nullptr || value->defined(), "the recompute of a checkpoint region took "
           "another path than its forward and reads ", name(t), " (in ", op, ") where the "
           "forward had modified it more times than values are kept for (", kMaxSteps,
           "; 1 for tensors over ", kMaxStepBytes >> 20, " MiB), so the value that read "
           "saw was not kept. The region's control flow depends on state outside its tensors "
           "(a Python flag changed by its first call?): keep that state the same for the "
           "recompute, run the first call outside checkpoint, or move the writes out of the "
           "checkpointed function.");
  if (value == nullptr) {
    HP_CHECK(t._version() == rec.end_version &&
                 (t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr) == rec.storage,
             modified_message(t, rec.op_key, rec.end_version));
  }
  const at::Tensor& from = value != nullptr ? *value : t;
  auto it = shadows_.find(impl);
  if (it == shadows_.end()) {
    shadows_.emplace(impl, copy_of(from));
  } else {
    c10::AutoGradMode no_grad(false);
    it->second.copy_(from.detach());
  }
  return true;
}

bool ExternalReads::follow(Read& rec, const at::Tensor& t, int64_t op_key, const void* op) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  size_t& pos = cursor_[impl];
  const auto& ops = rec.ops;
  if (pos < ops.size() && ops[pos] == op) {
    // (accesses from before a storage replacement, `.data = ...`, read the tensor as it
    // is: a recompute that makes the replacement again reads what torch's does)
    ++pos;
    return false;
  }
  size_t first = ops.size(), last = ops.size();
  for (size_t i = pos; i < ops.size(); ++i) {
    if (ops[i] != op) continue;
    if (first == ops.size()) first = i;
    last = i;
  }
  if (first == ops.size()) {  // an access the forward never made: the copy's value, as before
    pos = ops.size();
    return false;
  }
  HP_CHECK(value_at(rec, first) == value_at(rec, last), ambiguous_message(t, op_label(op_key)));
  const size_t was = pos;
  pos = first + 1;
  return take(rec, t, op_label(op_key), first, was);
}

at::Tensor ExternalReads::resolve(const at::Tensor& t, int64_t op_key, const void* op) {
  Read* rec = find(t);
  if (rec == nullptr) return t;
  if (rec->writes > 0 && follow(*rec, t, op_key, op)) {
    return shadows_.at(t.unsafeGetTensorImpl());
  }
  switch (rec->snap) {
    case Snap::kNone:
      HP_CHECK(t._version() == rec->version, modified_message(t, op_key, rec->version));
      return t;
    case Snap::kOverlapped:
      HP_CHECK(false, overlapped_message(t));
    case Snap::kLost:
    case Snap::kUndeclared:
      HP_CHECK(false, "the recompute of a checkpoint region needs the value that ", name(t),
               " had when the region's forward first read it, but the forward modified it "
               "through another tensor before writing it, so that value was not kept. Write it "
               "through one tensor (not a view and its base), or move the write out of the "
               "checkpointed function.");
    case Snap::kValue:
      break;
  }
  auto it = shadows_.find(t.unsafeGetTensorImpl());
  if (it == shadows_.end()) {
    it = shadows_.emplace(t.unsafeGetTensorImpl(), copy_of(rec->snapshot)).first;
  }
  return it->second;
}

std::vector<at::Tensor> ExternalReads::written_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& [impl, rec] : reads_) {
    if (rec.snap != Snap::kValue) continue;
    if (auto p = rec.ref.lock()) out.emplace_back(std::move(p));
  }
  return out;
}

bool ExternalReads::skipped_to_save(Read& rec, const at::Tensor& t) {
  // The op saving `t` reads its value where the forward's first access did not: the
  // recompute skipped the forward's accesses before its first read (see follow()), and the
  // copy takes the value that read saw.
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const auto c = cursor_.find(impl);
  if ((c != cursor_.end() && c->second != 0) || rec.first_read <= 0) {
    return false;  // (accessed already, or the forward read it first too, or never)
  }
  const auto first = static_cast<size_t>(rec.first_read);
  HP_CHECK(value_at(rec, first) == value_at(rec, static_cast<size_t>(rec.last_read)),
           ambiguous_message(t, "an op saving it"));
  cursor_[impl] = first;
  return take(rec, t, "an op saving it", first, std::nullopt);
}

ExternalReads::Save ExternalReads::recompute_save(const at::Tensor& t) {
  Save out{t, false};
  if (!t.defined() || reads_.empty()) return out;
  Read* rec = find(t);
  if (rec != nullptr && rec->writes > 0 && skipped_to_save(*rec, t)) {
    out.tensor = shadows_.at(t.unsafeGetTensorImpl());
    out.watch = true;
    return out;
  }
  // (written only by the batch norms' undeclared writes: saved as itself, as plain autograd
  // saves it; a later such write, which bumps no version, would change a copy saved instead)
  if (rec != nullptr && rec->snap == Snap::kValue && rec->declared) {
    auto it = shadows_.find(t.unsafeGetTensorImpl());
    if (it == shadows_.end()) {
      it = shadows_.emplace(t.unsafeGetTensorImpl(), copy_of(rec->snapshot)).first;
    }
    out.tensor = it->second;
    out.watch = true;
    return out;
  }
  if (!t.has_storage()) return out;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  for (const auto& [impl, shadow] : shadows_) {
    if (shadow.has_storage() && shadow.storage().unsafeGetStorageImpl() == storage) {
      out.watch = true;
      break;
    }
  }
  return out;
}

void ExternalReads::recompute_args(int64_t op_key, const void* op,
                                   std::vector<c10::IValue>& stack, size_t n,
                                   const std::vector<int>& writes) {
  if (reads_.empty()) return;
  resolve_args(op_key, op, stack, n);
  if (writes.empty() || shadows_.empty()) return;
  auto bump_if_copy = [this](const at::Tensor& t) {
    if (!t.defined()) return;
    for (const auto& [impl, shadow] : shadows_) {
      if (shadow.is_same(t)) {
        torch::autograd::impl::bump_version(t);
        return;
      }
    }
  };
  const size_t base = stack.size() - n;
  for (int w : writes) {
    if (w < 0 || static_cast<size_t>(w) >= n) continue;
    const c10::IValue& v = stack[base + static_cast<size_t>(w)];
    if (v.isTensor()) {
      bump_if_copy(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) bump_if_copy(t);
    }
  }
}

void ExternalReads::resolve_args(int64_t op_key, const void* op, std::vector<c10::IValue>& stack,
                                 size_t n) {
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue v = stack[i];
    c10::IValue& slot = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      at::Tensor r = resolve(t, op_key, op);
      if (!r.is_same(t)) slot = std::move(r);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> out;
      bool changed = false;
      out.reserve(list.size());
      for (const at::Tensor& t : list) {
        at::Tensor r = t.defined() ? resolve(t, op_key, op) : t;
        changed |= !r.is_same(t);
        out.push_back(std::move(r));
      }
      if (changed) slot = std::move(out);
    } else if (v.isList()) {
      // Tensor?[] (e.g. index): one level of optional tensors.
      auto list = v.toList();
      bool any = false;
      for (const c10::IValue& u : list) any |= u.isTensor();
      if (!any) continue;
      c10::impl::GenericList out(list.elementType());
      bool changed = false;
      for (const c10::IValue& u : list) {
        if (u.isTensor() && u.toTensor().defined()) {
          at::Tensor r = resolve(u.toTensor(), op_key, op);
          changed |= !r.is_same(u.toTensor());
          out.push_back(std::move(r));
        } else {
          out.push_back(u);
        }
      }
      if (changed) slot = std::move(out);
    }
  }
}

}  // namespace hyper_parallel::activation


