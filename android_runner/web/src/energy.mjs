// What a run reports about energy: android_runner/metrics.py's EnergyMeter, same fields, rounding and texts.
//
// Where the battery exposes current and voltage (or energy_now), the energy drawn while discharging is
// integrated from the readings and reported as measured. Otherwise, and while on the charger (the battery then
// shows the charge current, not the load), it is estimated from CPU time at ESTIMATE_WATTS_PER_CORE and
// labelled as an estimate. Platform-free: the caller passes cpuSeconds() (Node: process.cpuUsage(); a browser
// has no CPU clock, and then cpu_seconds and the estimate are null).
import { pyRound } from './gate/pyfmt.mjs';

export const ESTIMATE_WATTS_PER_CORE = 1.5;   // a phone big core under sustained load, roughly; only for the labelled estimate

const known = (x) => x !== null && x !== undefined;

export class EnergyMeter {
  constructor({ cpuSeconds = null } = {}) {
    this.measured_j = 0.0;
    this.measured_s = 0.0;
    this.first_percent = null;
    this.last_percent = null;
    this._last = null;
    this._cpuSeconds = cpuSeconds;
    this._cpu0 = cpuSeconds ? cpuSeconds() : null;
  }

  /** A battery reading taken at `now` (seconds, wall clock). */
  add(reading, now) {
    if (known(reading.percent)) {
      if (this.first_percent === null) this.first_percent = reading.percent;
      this.last_percent = reading.percent;
    }
    let power = null;
    if (reading.charging === false && known(reading.current_a) && known(reading.voltage_v)) {
      power = Math.abs(reading.current_a * reading.voltage_v);
    }
    const energyWh = reading.charging === false && known(reading.energy_wh) ? reading.energy_wh : null;
    if (this._last !== null) {
      const [t0, p0, e0] = this._last;
      const dt = now - t0;
      if (e0 !== null && energyWh !== null && e0 >= energyWh) {
        this.measured_j += (e0 - energyWh) * 3600.0;
        this.measured_s += dt;
      } else if (p0 !== null && power !== null) {
        this.measured_j += 0.5 * (p0 + power) * dt;
        this.measured_s += dt;
      }
    }
    this._last = [now, power, energyWh];
  }

  summary(wallS) {
    const cpuS = this._cpuSeconds ? this._cpuSeconds() - this._cpu0 : null;
    const out = {
      battery_percent_start: this.first_percent,
      battery_percent_end: this.last_percent,
      battery_percent_used: this.first_percent === null || this.last_percent === null
        ? null : pyRound(this.first_percent - this.last_percent, 2),
      cpu_seconds: cpuS === null ? null : pyRound(cpuS, 2),
      energy_estimate_j: cpuS === null ? null : pyRound(cpuS * ESTIMATE_WATTS_PER_CORE, 1),
      energy_estimate_basis: cpuS === null
        ? 'no CPU clock on this platform: no estimate'
        : `CPU seconds x ${ESTIMATE_WATTS_PER_CORE} W per busy core (an estimate, not a measurement)`,
    };
    if (this.measured_s > 0) {
      out.energy_measured_j = pyRound(this.measured_j, 1);
      out.energy_measured_over_s = pyRound(this.measured_s, 1);
      out.energy_measured_basis = 'battery current x voltage (or energy_now) integrated while discharging';
    }
    return out;
  }
}
