// Learning-rate schedules with linear warmup: ort_trainer/schedule.py, line for line (fp64, as Python).
// lrAt(s) is the rate of optimizer step s (0-based). The optimizer receives Math.fround(lrAt(s)):
// Python's Optimizer.set_learning_rate stores a C float.
export const SCHEDULES = ['cosine', 'linear', 'constant'];

export function lrFactor(step, warmup, total, schedule) {
  if (!SCHEDULES.includes(schedule)) throw new Error(`--schedule ${schedule}: use one of ${SCHEDULES.join(', ')}`);
  if (step < warmup) return step / Math.max(1, warmup);
  if (schedule === 'constant') return 1.0;
  const progress = (step - warmup) / Math.max(1, total - warmup);
  if (schedule === 'linear') return Math.max(0.0, 1.0 - progress);
  return Math.max(0.0, 0.5 * (1.0 + Math.cos(Math.PI * progress)));
}

export function lrAt(step, baseLr, warmup, total, schedule) {
  return baseLr * lrFactor(step, warmup, total, schedule);
}
