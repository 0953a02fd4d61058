// The loss plot: an inline SVG polyline of loss per step, with the range written at the axes.
const NS = 'http://www.w3.org/2000/svg';
const W = 600, H = 180, L = 48, R = 8, T = 8, B = 22;

function el(name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

/** Draw `losses` (loss of step i + 1 at index i) for a run of `total` steps into the <svg> `svg`. */
export function drawLoss(svg, losses, total) {
  svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
  svg.replaceChildren();
  svg.append(el('rect', { x: L, y: T, width: W - L - R, height: H - T - B, fill: 'none', stroke: '#bbb' }));
  if (!losses.length) {
    svg.append(el('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', fill: '#888' }, 'loss per step appears here'));
    return;
  }
  let lo = Math.min(...losses), hi = Math.max(...losses);
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const n = Math.max(total || losses.length, 2);
  const x = (i) => L + ((W - L - R) * i) / (n - 1);
  const y = (v) => T + ((H - T - B) * (hi - v)) / (hi - lo);
  const points = losses.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(' ');
  svg.append(el('polyline', { points, fill: 'none', stroke: '#1a73e8', 'stroke-width': 1.5 }));
  svg.append(el('text', { x: L - 4, y: T + 10, 'text-anchor': 'end', 'font-size': 11 }, hi.toFixed(3)));
  svg.append(el('text', { x: L - 4, y: H - B, 'text-anchor': 'end', 'font-size': 11 }, lo.toFixed(3)));
  svg.append(el('text', { x: L, y: H - 6, 'font-size': 11 }, 'step 1'));
  svg.append(el('text', { x: W - R, y: H - 6, 'text-anchor': 'end', 'font-size': 11 }, `step ${n}`));
}
