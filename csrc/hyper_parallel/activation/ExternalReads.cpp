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

void ExternalReads::note(const at::Tensor& t, int64_t op_key) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (produced_.count(impl)) return;
  auto it = reads_.find(impl);
  if (it != reads_.end() && !it->second.ref.expired()) return;
  Read r(t);
  r.version = t._version();
  r.op_key = op_key;
  if (r.storage != nullptr) by_storage_[r.storage].push_back(impl);
  reads_.insert_or_assign(impl, std::move(r));
}

void ExternalReads::forward_inputs(int64_t op_key, c10::ArrayRef<c10::IValue> args,
                                   const std::vector<int>& writes,
                                   const std::vector<int>& declared) {
  if (forward_over_) return;
  for (const auto& v : args) for_tensors(v, [&](const at::Tensor& t) { note(t, op_key); });
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
    if (rec.snap != Snap::kNone && rec.snap != Snap::kValue) continue;
    auto p = rec.ref.lock();
    if (!p) continue;
    const at::Tensor u(std::move(p));
    if (!u.has_storage() || u.storage().unsafeGetStorageImpl() != storage) continue;
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
      rec.snapshot = copy_of(u);
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
      produced_.insert(t.unsafeGetTensorImpl());
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

at::Tensor ExternalReads::resolve(const at::Tensor& t, int64_t op_key) {
  Read* rec = find(t);
  if (rec == nullptr) return t;
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

ExternalReads::Save ExternalReads::recompute_save(const at::Tensor& t) {
  Save out{t, false};
  if (!t.defined() || reads_.empty()) return out;
  Read* rec = find(t);
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

void ExternalReads::recompute_args(int64_t op_key, std::vector<c10::IValue>& stack, size_t n,
                                   const std::vector<int>& writes) {
  if (reads_.empty()) return;
  resolve_args(op_key, stack, n);
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

void ExternalReads::resolve_args(int64_t op_key, std::vector<c10::IValue>& stack, size_t n) {
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue v = stack[i];
    c10::IValue& slot = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      at::Tensor r = resolve(t, op_key);
      if (!r.is_same(t)) slot = std::move(r);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> out;
      bool changed = false;
      out.reserve(list.size());
      for (const at::Tensor& t : list) {
        at::Tensor r = t.defined() ? resolve(t, op_key) : t;
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
          at::Tensor r = resolve(u.toTensor(), op_key);
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
