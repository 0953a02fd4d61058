// Global-norm clipping and AdamW with ORT's kernels' float32 arithmetic (onnxruntime 1.19,
// orttraining/training_ops/cpu/optimizer: AdamWOptimizer adam_mode 0 = PyTorch's
// AdamW: bias correction on m and v, decoupled weight decay before the update). Every float32 operation of
// the C++ kernels is one Math.fround here (Float32Array stores round too), in the kernels' order.
const f = Math.fround;

/** The attributes the optimizer graph would carry (float32), from manifest.optimizer + the run's clip/decay. */
export function adamwSpec({ beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, clip = 1.0 } = {}) {
  return { alpha: f(beta1), beta: f(beta2), epsilon: f(eps), weightDecay: f(weight_decay), maxNorm: clip ? f(clip) : null };
}

/** L2 norm of all gradients as the device's optimizer graph computes it (ort_trainer/optimizer_graph.py): per
 * tensor a sum of squares, then those sums in ascending order, added in float32, so the order of the tensors does
 * not matter. The sums are exact-then-rounded here where ORT's reductions round as they go: the last bit may
 * differ. */
export function globalNorm(grads) {
  const sums = Float32Array.from(grads, (g) => {
    let s = 0;
    for (let i = 0; i < g.length; i++) s += g[i] * g[i];
    return s;
  }).sort();
  let total = 0;
  for (const s of sums) total = f(total + s);
  return f(Math.sqrt(total));
}

/** Global-norm clipping: grads *= min(max_norm / (norm + 1e-6), 1), in place. Returns the pre-clip norm. */
export function clipGradNorm(grads, maxNorm) {
  const norm = globalNorm(grads);
  const coef = Math.min(f(maxNorm / f(norm + f(1e-6))), 1.0);
  for (const g of grads) for (let i = 0; i < g.length; i++) g[i] = f(g[i] * coef);
  return norm;
}

/** One AdamW update, in place. `step` is the 1-based optimizer step ORT feeds (completed steps + 1),
 * `lr` the float32 learning rate. params/grads/m/v: arrays of Float32Array, same order. */
export function adamwStep(spec, params, grads, m, v, lr, step) {
  const { alpha, beta, epsilon, weightDecay } = spec;
  lr = f(lr);
  // std::pow(float, int64) is a double pow; cast to float, then 1.f - it.
  const alphaCorr = f(1 - f(Math.pow(alpha, step)));
  const betaCorr = f(1 - f(Math.pow(beta, step)));
  const oneMinusAlpha = f(1 - alpha), oneMinusBeta = f(1 - beta);
  for (let k = 0; k < params.length; k++) {
    const w = params[k], g = grads[k], m1 = m[k], m2 = v[k];
    for (let i = 0; i < w.length; i++) {
      let wi = f(w[i] - f(f(w[i] * lr) * weightDecay));
      const gi = g[i];
      const mi = f(f(alpha * m1[i]) + f(oneMinusAlpha * gi));
      const vi = f(f(beta * m2[i]) + f(f(oneMinusBeta * gi) * gi));
      const denom = f(f(Math.sqrt(f(vi / betaCorr))) + epsilon);
      wi = f(wi - f(f(lr * mi) / f(alphaCorr * denom)));
      w[i] = wi; m1[i] = mi; m2[i] = vi;
    }
  }
}
