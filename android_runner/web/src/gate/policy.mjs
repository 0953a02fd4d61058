// The battery/thermal gate: android_runner/gate.py line for line (same states, defaults, reasons, error texts
// and run-summary fields; tests/test_web_gate.py replays the same traces through both and compares).
//
// States, in order of priority:
//   COOLING  temperature above max_temp; stays until it is <= max_temp - cool_hysteresis. The runner does not
//            train; it waits poll_s and asks again. Unknown temperature: no thermal gating.
//   FULL     while charging (or when there is no battery reading at all).
//   PAUSED   below pause_below and not charging; stays until above resume_above or charging. The runner
//            checkpoints and waits poll_s between reads.
//   SLOW     below slow_below and not charging; the runner sleeps after each step so that it trains only
//            slow_factor of the wall time.
//   FULL     otherwise.
// "Not charging" includes an unknown charging state: a low battery is protected either way.
//
// Data objects keep Python's snake_case field names (Decision.sleep_s, GateConfig.pause_below, summary keys) so
// that what the web runner logs and writes reads the same as the Python runner's. Pure JS: Node and browser.
import { formatG, formatPercent, pyRepr, pyRound } from './pyfmt.mjs';

export const GateState = Object.freeze({ FULL: 'full', SLOW: 'slow', PAUSED: 'paused', COOLING: 'cooling' });
const STATES = Object.values(GateState);

/** A GateState from its value ('full', ...): Python's GateState(x). */
export function gateState(value) {
  if (STATES.includes(value)) return value;
  throw new Error(`${pyRepr(value)} is not a valid GateState`);
}

// Field order matters: validate() checks (and names) the first bad field in this order, like Python's fields().
export const GATE_DEFAULTS = Object.freeze({
  slow_below: 60.0,     // percent; below this and not charging -> SLOW
  slow_factor: 0.5,     // fraction of the duty cycle used when SLOW
  pause_below: 15.0,    // below this and not charging -> PAUSED (runner checkpoints and waits)
  resume_above: 30.0,   // leave PAUSED when percent > resume_above, or when charging
  max_temp: 42.0,       // above this -> COOLING (wait)
  cool_hysteresis: 3.0, // leave COOLING when temp <= max_temp - cool_hysteresis
  poll_s: 30.0,         // how long to wait between reads while PAUSED/COOLING
});
const FIELDS = Object.keys(GATE_DEFAULTS);

export class GateConfig {
  /** new GateConfig({pause_below: 20, ...}): Python's GateConfig(**options); unknown options are an error. */
  constructor(options = {}) {
    const unknown = Object.keys(options ?? {}).filter((k) => !FIELDS.includes(k));
    if (unknown.length) {
      throw new TypeError(`unknown gate option(s) ${unknown.join(', ')}; valid: ${FIELDS.join(', ')}`);
    }
    for (const name of FIELDS) this[name] = options?.[name] === undefined ? GATE_DEFAULTS[name] : options[name];
    Object.freeze(this);
  }

  /** Throw an Error naming the bad option and how to fix it (gate.py's texts); return this if fine. */
  validate() {
    for (const name of FIELDS) {
      const v = this[name];
      if (typeof v !== 'number' || !Number.isFinite(v)) throw new Error(`${name} must be a finite number, got ${pyRepr(v)}`);
    }
    for (const name of ['slow_below', 'pause_below', 'resume_above']) {
      const v = this[name];
      if (!(v >= 0 && v <= 100)) throw new Error(`${name} is a battery percent: must be within 0..100, got ${formatG(v)}`);
    }
    if (!(this.slow_factor > 0 && this.slow_factor <= 1)) {
      throw new Error('slow_factor must be in (0, 1] (the fraction of time spent training ' +
        `when SLOW; 1 disables slowing), got ${formatG(this.slow_factor)}`);
    }
    if (!(this.pause_below < this.resume_above)) {
      throw new Error(`pause_below (${formatG(this.pause_below)}) must be < resume_above ` +
        `(${formatG(this.resume_above)}): lower pause_below or raise resume_above`);
    }
    if (this.cool_hysteresis < 0) {
      throw new Error('cool_hysteresis must be >= 0 (degrees below max_temp to resume), ' +
        `got ${formatG(this.cool_hysteresis)}`);
    }
    if (this.poll_s <= 0) {
      throw new Error(`poll_s must be > 0 (seconds between reads while waiting), got ${formatG(this.poll_s)}`);
    }
    return this;
  }

  /** The fields in order, as Python's dataclasses.asdict (run.json's "gate"). */
  toJSON() {
    return Object.fromEntries(FIELDS.map((k) => [k, this[k]]));
  }
}

const pct = (p) => `${formatG(p)}%`;
const deg = (t) => `${formatG(t)}°C`;
const known = (x) => x !== null && x !== undefined;

/**
 * The state to be in now, given the latest reading ({percent, charging, temp_c}; null = unknown), the config
 * and the previous state. lastStepS is how long the last training step took; SLOW sleeps
 * lastStepS * (1/slow_factor - 1) so that training takes slow_factor of the time.
 * Returns a Decision {state, sleep_s, run_step, reason, changed} (frozen).
 */
export function decide(reading, cfg, prev, lastStepS) {
  prev = gateState(prev);
  const temp = reading.temp_c, p = reading.percent;
  const coolLimit = cfg.max_temp - cfg.cool_hysteresis;

  const out = (state, reason, sleepS = 0.0) => {
    const waiting = state === GateState.PAUSED || state === GateState.COOLING;
    if (prev === GateState.COOLING && state !== GateState.COOLING) {
      const cooled = known(temp) ? `cooled to ${deg(temp)} <= ${deg(coolLimit)}` : 'temperature unknown';
      reason = `${cooled}; ${reason}`;
    }
    return Object.freeze({ state, sleep_s: waiting ? cfg.poll_s : sleepS, run_step: !waiting, reason,
      changed: state !== prev });
  };

  if (known(temp)) {
    if (temp > cfg.max_temp) return out(GateState.COOLING, `temperature ${deg(temp)} > max-temp ${deg(cfg.max_temp)}`);
    if (prev === GateState.COOLING && temp > coolLimit) {
      return out(GateState.COOLING, `cooling: ${deg(temp)}, waiting for <= ${deg(coolLimit)}`);
    }
  }
  if (!known(p)) return out(GateState.FULL, 'no battery reading');
  if (reading.charging) return out(GateState.FULL, `charging (battery ${pct(p)})`);
  const plug = reading.charging === false ? 'not charging' : 'charging state unknown';
  if (p < cfg.pause_below) {
    return out(GateState.PAUSED, `battery ${pct(p)} < pause-below ${pct(cfg.pause_below)} and ${plug}`);
  }
  if (prev === GateState.PAUSED && p <= cfg.resume_above) {
    return out(GateState.PAUSED, `paused: battery ${pct(p)} <= resume-above ${pct(cfg.resume_above)} and ${plug}`);
  }
  if (p < cfg.slow_below) {
    const step = typeof lastStepS === 'number' && Number.isFinite(lastStepS) ? lastStepS : 0.0;
    const sleepS = (step > 0 ? step : 0.0) * (1.0 / cfg.slow_factor - 1.0);   // Python's max(0.0, step)
    return out(GateState.SLOW, `battery ${pct(p)} < slow-below ${pct(cfg.slow_below)} and ${plug}: ` +
      `training ${formatPercent(cfg.slow_factor, 0)} of the time`, sleepS);
  }
  return out(GateState.FULL, `battery ${pct(p)} >= slow-below ${pct(cfg.slow_below)}`);
}

const monotonic = () => performance.now() / 1000;

/**
 * Applies decide() reading after reading; keeps the seconds spent in each state and the transitions
 * [t, from, to, reason] (t in seconds since the first update). clock() returns seconds.
 */
export class GateTracker {
  constructor(cfg = null, { initial = GateState.FULL, clock = monotonic } = {}) {
    this.cfg = (cfg instanceof GateConfig ? cfg : new GateConfig(cfg ?? {})).validate();
    this.state = gateState(initial);
    this.clock = clock;
    this.seconds_in = Object.fromEntries(STATES.map((s) => [s, 0.0]));
    this.transitions = [];
    this.last = null;
    this._t0 = null;
    this._tLast = null;
  }

  /** Credit the time since the last update to the current state; return now. */
  _advance(now) {
    now = known(now) ? now : this.clock();
    if (this._t0 === null) this._t0 = now;
    else this.seconds_in[this.state] += Math.max(0.0, now - this._tLast);
    this._tLast = now;
    return now;
  }

  /** Decide for this reading (now defaults to the tracker's clock); returns the Decision. */
  update(reading, lastStepS = 0.0, now = null) {
    now = this._advance(now);
    const d = decide(reading, this.cfg, this.state, lastStepS);
    if (d.changed) this.transitions.push([now - this._t0, this.state, d.state, d.reason]);
    this.state = d.state;
    this.last = d;
    return d;
  }

  /** Credit the time up to now (end of run) to the current state. */
  finish(now = null) {
    if (this._t0 !== null) this._advance(now);
  }

  /** JSON-friendly numbers for the run summary (gate.py's keys and rounding). */
  summary() {
    return {
      final_state: this.state,
      seconds_in: Object.fromEntries(STATES.map((s) => [s, pyRound(this.seconds_in[s], 3)])),
      transitions: this.transitions.map(([t, a, b, r]) => ({ t_s: pyRound(t, 3), from: a, to: b, reason: r })),
    };
  }
}
