#include "hyper_parallel/activation/OpPolicyTable.h"

#include "hyper_parallel/common/Macros.h"

#include <deque>

namespace hyper_parallel::activation {

namespace {

struct NameRegistry {
  std::mutex mu;
  std::unordered_map<std::string, int64_t> keys;
  std::deque<std::string> names;  // deque: stable references while growing
};

NameRegistry& registry() {
  static NameRegistry* r = new NameRegistry();  // leaked: used by hooks at exit
  return *r;
}

// Number of non-empty dot-separated parts of `name`, or -1 if a part is empty.
int count_parts(std::string_view name) {
  if (name.empty()) return -1;
  int parts = 1;
  size_t start = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    if (i == name.size() || name[i] == '.') {
      if (i == start) return -1;
      if (i < name.size()) ++parts;
      start = i + 1;
    }
  }
  return parts;
}

}  // namespace

// ---------------------------------------------------------------- OpNames

std::string OpNames::normalise(std::string_view name) {
  std::string out(name);
  const size_t pos = out.find("::");
  if (pos != std::string::npos) out.replace(pos, 2, ".");
  return out;
}

std::string_view OpNames::packet_of(std::string_view name) {
  if (count_parts(name) != 3) return {};
  return name.substr(0, name.rfind('.'));
}

int64_t OpNames::intern(std::string_view name) {
  HP_CHECK_VALUE(!name.empty(), "an op name must not be empty");
  std::string key = normalise(name);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.keys.find(key);
  if (it != r.keys.end()) return it->second;
  const auto id = static_cast<int64_t>(r.names.size());
  r.names.push_back(key);
  r.keys.emplace(std::move(key), id);
  return id;
}

std::string OpNames::name(int64_t key) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  HP_CHECK_VALUE(key >= 0 && key < static_cast<int64_t>(r.names.size()), "unknown op key ", key,
                 "; op keys come from OpNames::intern (hyper_parallel._C.intern_op)");
  return r.names[static_cast<size_t>(key)];
}

int64_t OpNames::size() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return static_cast<int64_t>(r.names.size());
}

// ---------------------------------------------------------------- OpPolicyTable

OpPolicyTable::OpPolicyTable(CheckpointPolicy default_policy) : default_(default_policy) {}

void OpPolicyTable::set(std::string_view name, CheckpointPolicy policy) {
  std::string key = OpNames::normalise(name);
  const int parts = count_parts(key);
  HP_CHECK_VALUE(parts == 2 || parts == 3, "'", std::string(name),
                 "' is not an op name a policy table understands. Use 'namespace.op' for every "
                 "overload of an op (e.g. 'aten.mm') or 'namespace.op.overload' for one overload "
                 "(e.g. 'aten.mm.default'), as str(torch.ops.aten.mm.default) prints.");
  std::lock_guard<std::mutex> lock(mu_);
  auto& map = parts == 3 ? overloads_ : packets_;
  if (map.find(key) == map.end()) order_.push_back(key);
  map[key] = policy;
  memo_.clear();
}

void OpPolicyTable::set_default(CheckpointPolicy policy) {
  std::lock_guard<std::mutex> lock(mu_);
  default_ = policy;
  memo_.clear();
}

CheckpointPolicy OpPolicyTable::default_policy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return default_;
}

CheckpointPolicy OpPolicyTable::lookup_locked(std::string_view op_name) const {
  const std::string name = OpNames::normalise(op_name);
  if (auto it = overloads_.find(name); it != overloads_.end()) return it->second;
  const std::string_view packet = OpNames::packet_of(name);
  if (!packet.empty()) {
    if (auto it = packets_.find(std::string(packet)); it != packets_.end()) return it->second;
  } else if (auto it = packets_.find(name); it != packets_.end()) {
    return it->second;  // a packet name asked directly
  }
  return default_;
}

CheckpointPolicy OpPolicyTable::lookup(std::string_view op_name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lookup_locked(op_name);
}

CheckpointPolicy OpPolicyTable::policy_for(int64_t op_key) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (op_key >= 0 && static_cast<size_t>(op_key) < memo_.size() && memo_[op_key] >= 0) {
    return static_cast<CheckpointPolicy>(memo_[op_key]);
  }
  const std::string name = OpNames::name(op_key);  // throws for unknown keys
  const CheckpointPolicy p = lookup_locked(name);
  if (static_cast<size_t>(op_key) >= memo_.size()) memo_.resize(op_key + 1, -1);
  memo_[op_key] = static_cast<int8_t>(p);
  return p;
}

std::vector<std::pair<std::string, CheckpointPolicy>> OpPolicyTable::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, CheckpointPolicy>> out;
  out.reserve(order_.size());
  for (const auto& name : order_) {
    auto it = overloads_.find(name);
    out.emplace_back(name, it != overloads_.end() ? it->second : packets_.at(name));
  }
  return out;
}

size_t OpPolicyTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.size();
}

}  // namespace hyper_parallel::activation
