#include "hyper_parallel/activation/SavedBytesMeter.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace hyper_parallel::activation {
namespace {

at::Tensor bytes(int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kByte)); }

// The meter is the active one for the test's scope, as saved_activation_memory() makes it.
class SavedBytesMeterTest : public ::testing::Test {
 protected:
  void SetUp() override { SavedBytesMeter::set_active(&meter); }
  void TearDown() override { SavedBytesMeter::set_active(nullptr); }
  SavedBytesMeter meter;
};

// A saved object released while the storage lives on (someone else holds it a moment
// longer): once that holder lets go, the storage leaves the total before the next saves
// are added, whether or not anything else was released meanwhile. (It had been taken out
// only when a later release or a full recount came, so a reloaded storage a copy worker
// held a moment after autograd freed it counted into the next micro-batch's forward:
// CI, test_memory.py, 20 480 B read where one micro-batch holds 14 336 B.)
TEST_F(SavedBytesMeterTest, AStorageHeldAMomentAfterItsReleaseLeavesBeforeTheNextSaves) {
  at::Tensor saved = bytes(1000);
  meter.observe(saved);
  at::Tensor holder = saved;  // the other holder (a copy worker's task)
  const c10::StorageImpl* key = saved.storage().unsafeGetStorageImpl();
  saved.reset();
  SavedBytesMeter::note_release(key);  // the saved object is destroyed
  at::Tensor b = bytes(500);
  meter.observe(b);  // the released storage is still alive: it still counts
  EXPECT_EQ(meter.peak(), 1500);
  holder.reset();  // now it dies
  at::Tensor c = bytes(700);
  meter.observe(c);
  EXPECT_EQ(meter.peak(), 1500);  // not 2200
  EXPECT_EQ(meter.sample(), 1200);
}

// Storages the caller keeps after their release (a list of micro-batch inputs) go on
// counting while they live, however many there are, and each leaves once it dies.
TEST_F(SavedBytesMeterTest, ManyHeldStoragesCountWhileAliveAndLeaveWhenTheyDie) {
  std::vector<at::Tensor> held;
  for (int i = 0; i < 600; ++i) {  // more than the watch checks at every observe
    at::Tensor t = bytes(10);
    meter.observe(t);
    held.push_back(t);
    const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    t.reset();
    SavedBytesMeter::note_release(key);
  }
  at::Tensor probe = bytes(1);
  meter.observe(probe);
  EXPECT_EQ(meter.peak(), 6001);
  held.clear();  // they die: no saved object is released, nothing else happens
  std::vector<at::Tensor> fresh;
  for (int i = 0; i < 700; ++i) {  // a long watch is checked once per as many observes
    fresh.push_back(bytes(1));
    meter.observe(fresh.back());
  }
  EXPECT_LE(meter.peak(), 6001 + 600);
  at::Tensor big = bytes(5000);
  meter.observe(big);  // the 6000 dead bytes have left: 5701 live
  EXPECT_LE(meter.peak(), 6001 + 600);
  EXPECT_EQ(meter.sample(), 5701);
}

}  // namespace
}  // namespace hyper_parallel::activation
