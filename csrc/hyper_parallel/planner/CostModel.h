#pragma once
// CostModel: predicted peak saved-activation bytes and step time of a per-layer plan
// (docs/design.md, "Planner"). Pure arithmetic on a profile, no tensors.
//
// The schedule it models is SPEC 3 with prefetch depth d (SwapManager().set_prefetch_depth),
// for a chain L0 .. Ln-1:
//  * forward: at the end of Lk's forward (its release point) the D2H copy of its
//    offloaded bytes is queued on the D2H stream (FIFO); its device bytes stop counting at
//    that point, as the library's meter sees it. The forward never waits for a D2H copy.
//  * backward: when Lj's backward begins (its output gradient arrives), the engine reloads
//    Lj itself (if not reloaded yet) and Lj-1 .. Lj-d, nearest first (SwapEngine::
//    backward_begin); so Lk's reload is issued when Lk+d's backward begins (at the first
//    backward, that of Ln-1, for k >= n-1-d). Reloads run one after another on the H2D
//    stream (FIFO, in that order), each once its D2H copy has finished; Lk's backward
//    computes once both its gradient and its reload are there (a reload longer than its
//    window stalls the step). With d = 0 every reload is fully exposed.
//  * deferred bytes: what a release point cannot offload because the caller still holds it
//    (SwapEngine's deferred frees: a decoder loop holds a layer's input until the layer
//    returns) is offloaded at the next release point, after that point's own offloads
//    and outside the offload window (SwapEngine::retry_deferred_locked), and reloaded
//    with its own layer. Deferred bytes with no release point after them before the turn
//    stay on the device.
//  * the last layer offloads nothing; its bytes stay on the device.
//  * held bytes: a layer's saved storages that the caller still holds when the backward
//    ends (the loop variable holding the last layer's input, a list of hidden states, a
//    module's buffer) are not freed by the layer's backward: they stay on the device, and
//    count, until the step ends. They are part of what stays on the device in the forward
//    (a release point defers a storage in use elsewhere, and it stays in use). The same for
//    the head's saves (tail_held_bytes): the caller holds the head's input.
//  * shared charge: the meter counts a storage once, when the first layer saves it, and a
//    uniform profile charges layer 0 for what all layers share (a decoder's causal mask).
//    In an assignment, the first layer k >= 1 of an option that no layer before it runs
//    keeps its shared_bytes too (until its backward), since layer 0's option may not
//    save them. An upper bound: options that save the same shared tensors pay them again.
//  * boundary charge: layer k keeps max(0, input_bytes(k) - output_bytes(k-1)) beyond its
//    kept_bytes (OptionCost; k = 0: its input_bytes), the part of the storage between
//    Lk-1 and Lk that Lk saves and Lk-1's option does not. Uniform profiles charge that
//    storage to whichever layer saved it first; a mixed pair can save it on one side only
//    (checkpoint then none: the none layer's Linear saves the checkpoint layer's output).
//  * release points: in a plan where any layer swaps, every layer is on the prefetch chain
//    and the end of every layer's forward is a release point, whatever its strategy
//    (apply_activation_memory chains them all: each gets a swap group).
//  * offload window W (SwapEngine's offload_window; 0 = none): a release point submits
//    queued offloads, oldest first, only while fewer than W submitted copies are unfinished
//    at that moment; the rest wait for a later release point, and at the release points of the last two
//    layers a queue whose oldest entry is not the layer ending there stays as it is. An
//    offload still waiting at the turn never happens: its bytes count as kept until its
//    backward and it reloads nothing. A waiting layer's bytes count on the device until
//    its offload is submitted. (docs/design.md, "Offload window".)
// A copy of n bytes takes latency + n * seconds_per_byte (measured per direction).
//
// Peak bytes are the largest of these sample points (the meter's, SPEC 6), with W = 0 and
// sent(i) the bytes of Li that left the device in the forward (its offload, plus its
// deferred bytes once a later release point took them):
//  * end of Lk's forward, before its release:
//                      base + (bytes of L0..Lk-1 still on the device) + saved(k)
//  * end of the forward (with the head's saves): base + saved(L0..Ln-1) - sent(L0..Ln-1) + tail
//  * start of Lk's backward, its reloads issued:
//                      base + saved(L0..Lk) - sent(L0..Lk) + sent(k-d .. k)
//                      + held(Lk+1..Ln-1) + tail_held
// (With W > 0 the offload bytes of layers still waiting count on the device; a layer
// never offloaded counts as kept.)
// Host bytes: every offloaded byte is on the host at the end of the forward (the D2H
// copies of a step all precede its first reload), so the host peak is the sum of the
// offloads (payload bytes; a capped pool also rounds blocks to size classes).
// Recomputation inside a backward creates tensors that are not saved activations of the
// step; the meter does not count them, and neither does the model.
//
// Thread-safety: plain values; evaluate() is a pure function.

#include <cstdint>
#include <string>
#include <vector>

namespace hyper_parallel::planner {

// The cost of one strategy ("option") for one layer, as profiled.
// A layer's saved bytes (saved = kept + offload + deferred) split by when they leave the
// device; offload + deferred is what its group reloads before its backward.
struct OptionCost {
  int64_t kept_bytes = 0;      // saved bytes on device from its forward to its backward
  int64_t offload_bytes = 0;   // saved bytes offloaded at its own release point (0 for
                               // strategies that do not swap)
  double forward_seconds = 0.0;
  double backward_seconds = 0.0;  // including any recompute
  int64_t deferred_bytes = 0;  // saved bytes its release point defers because the caller
                               // still holds them (the layer's input, in a decoder loop):
                               // offloaded at the next release point, reloaded with this
                               // layer (docs/design.md, "Deferred inputs")
  int64_t shared_bytes = 0;    // bytes it saves that an earlier layer saved first (the mask
                               // all layers save), not in kept_bytes: the profile's layer 0
                               // paid them. Charged (see the header) to the first layer of
                               // an option no earlier layer ran.
  int64_t held_bytes = 0;      // of the bytes that stay on the device (kept_bytes; for the
                               // last layer all it saves), those the caller still holds when
                               // the backward ends: not freed by its backward, they count
                               // until the step ends (docs/design.md, "Held by the caller");
                               // evaluate() counts at most the layer's bytes that were not
                               // sent (a figure above them is read as all of them)
  // The storage one layer hands the next (its output, the next layer's input: a ReLU or
  // tanh at the end of a block saves it, and so does the next block's first Linear) is one
  // storage, counted once whichever of the two saves it (docs/design.md, "Boundary
  // storages"). output_bytes: the bytes of its output's storage this option saves (they are
  // in kept_bytes); input_bytes: those of its input's storage it saves, NOT in kept_bytes:
  // the model charges max(0, input_bytes - the previous layer's option's output_bytes) to
  // this layer (all of them at layer 0), kept until its backward. Both 0 for options that
  // swap (their attribution is the profile's, unchanged).
  int64_t input_bytes = 0;
  int64_t output_bytes = 0;
  int64_t saved_bytes() const { return kept_bytes + offload_bytes + deferred_bytes; }
  int64_t group_bytes() const { return offload_bytes + deferred_bytes; }
};

// One direction of the copy link: a copy of n bytes takes latency + n * seconds_per_byte.
// The most bytes a profile may add up to (StepProfile::validate()): 2^60.
inline constexpr int64_t kMaxProfileBytes = int64_t{1} << 60;

struct CopyLink {
  double latency_seconds = 0.0;
  double seconds_per_byte = 0.0;
  double seconds(int64_t bytes) const {
    return bytes > 0 ? latency_seconds + seconds_per_byte * static_cast<double>(bytes) : 0.0;
  }
};

struct StepProfile {
  std::vector<std::string> options;             // strategy names, one per column
  std::vector<std::vector<OptionCost>> layers;  // [layer][option], forward order
  int64_t base_bytes = 0;   // saved before the first layer (embedding); held all step
  int64_t tail_bytes = 0;   // saved after the last layer (head, loss); freed before the
                            // last layer's backward begins
  int64_t tail_held_bytes = 0;  // of tail_bytes, what the caller holds until the step ends
                                // (the head's input, still referenced): counted at every
                                // backward sample point
  double outside_seconds = 0.0;  // step time outside the layers and the tail window
  double tail_seconds = 0.0;     // end of the last layer's forward -> start of its backward
  CopyLink d2h;
  CopyLink h2d;
  int prefetch_depth = 1;  // layers reloaded ahead in backward (the engine's setting, >= 0)
  int offload_window = 0;  // the engine's offload window (>= 0; 0: every release submits)

  size_t num_layers() const { return layers.size(); }
  size_t num_options() const { return options.size(); }
  // Throws c10::ValueError (prefixed "hyper_parallel:") for a ragged table, negative bytes
  // or times, non-finite values, more than 64 options, or a negative prefetch depth or
  // offload window.
  void validate() const;
  // The cost of `option` at `layer`, with the last-layer rule applied (its offload and
  // deferred bytes become kept bytes).
  OptionCost effective(size_t layer, size_t option) const;
};

struct Prediction {
  int64_t peak_bytes = 0;       // largest saved-activation bytes on device
  double step_seconds = 0.0;    // forward + backward of one step
  double stall_seconds = 0.0;   // part of step_seconds spent waiting for copies
  int64_t offload_bytes = 0;    // bytes copied to the host (and back) per step (deferred
                                // bytes included)
  int64_t host_peak_bytes = 0;  // bytes on the host at the end of the forward (their sum)
  int peak_layer = -1;          // layer of the peak sample point (-1: the tail)
  bool peak_in_backward = false;
};

// The boundary charge of `option` at `layer` after option `previous` of the layer before
// (-1: none, at layer 0): max(0, input_bytes - previous's output_bytes), bytes.
int64_t boundary_charge(const StepProfile& profile, size_t layer, int option, int previous);

// The same profile with each layer's least boundary charge moved into kept_bytes: for
// option o of layer k, with M the most output_bytes of layer k-1's options (0 at layer 0),
// kept_bytes += max(0, input_bytes - M) and input_bytes = min(input_bytes, M). Every
// assignment's prediction is unchanged (the charge max(0, in - out) splits into those two
// parts for every out <= M), and kept_bytes is then the least any plan keeps there, which
// the planner's relaxations and bounds read (a decoder, whose layers hand on a storage no
// option saves as output, then has no charge left: its bounds are as tight as before
// boundary charges, 25 000 labels for a tiled 100-layer Llama where the charge-free
// kept_bytes had left 500 000).
StepProfile with_least_boundary_charges(StepProfile profile);

// Predicts one assignment (an option index per layer) by simulating the schedule above
// event by event. Throws c10::ValueError for an assignment of the wrong length, an option
// index out of range, or a profile of more than 64 options.
Prediction evaluate(const StepProfile& profile, const std::vector<int>& assignment);

}  // namespace hyper_parallel::planner
