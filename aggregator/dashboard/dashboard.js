'use strict';
const POLL_MS = 2000;
const STATES = ['connected', 'training', 'late', 'dropped', 'revoked'];
const SVG_NS = 'http://www.w3.org/2000/svg';

// ?token=... once, then kept for this tab only and taken off the address bar.
const token = (() => {
  const params = new URLSearchParams(location.search);
  let value = params.get('token');
  try {
    if (value) {
      sessionStorage.setItem('fedmesh-token', value);
      params.delete('token');
      const rest = params.toString();
      history.replaceState(null, '', location.pathname + (rest ? '?' + rest : '') + location.hash);
    } else {
      value = sessionStorage.getItem('fedmesh-token');
    }
  } catch (e) { /* storage off: the token lives in this variable only */ }
  return value || '';
})();

const $ = (id) => document.getElementById(id);
function node(tag, attributes, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attributes || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function svgNode(tag, attributes, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attributes || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); }
function isNumber(v) { return typeof v === 'number' && isFinite(v); }
function percent(v) { return isNumber(v) ? (100 * v).toFixed(2) + '%' : '\u2013'; }
function bytes(n) {
  if (!isNumber(n)) return '\u2013';
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; ++i; }
  return (i === 0 ? String(n) : n.toFixed(n < 10 ? 2 : 1)) + ' ' + units[i];
}
function ago(seconds) {
  if (!isNumber(seconds) || seconds < 0) return 'never';
  if (seconds < 1) return 'just now';
  if (seconds < 90) return Math.round(seconds) + ' s ago';
  if (seconds < 5400) return Math.round(seconds / 60) + ' min ago';
  return (seconds / 3600).toFixed(1) + ' h ago';
}
function clock(ms) { return new Date(ms).toLocaleTimeString([], {hour12: false}); }

let latest = null, fetchedAt = 0;

function showError(text) {
  const box = $('error');
  box.textContent = text;
  box.style.display = text ? 'block' : 'none';
  $('live').className = text ? 'bad' : 'ok';
}

async function poll() {
  try {
    const response = await fetch('status', {cache: 'no-store', headers: token ? {'Authorization': 'Bearer ' + token} : {}});
    if (response.status === 401) {
      showError('This aggregator needs its access token: open the dashboard as /dashboard?token=TOKEN ' +
                '(the metrics_token of its config).');
      $('live').textContent = 'not authorized';
    } else if (!response.ok) {
      throw new Error('status answered ' + response.status);
    } else {
      latest = await response.json();
      fetchedAt = Date.now();
      render(latest);
      showError('');
      $('live').textContent = 'live \u00b7 ' + clock(fetchedAt);
      document.body.dataset.loaded = 'true';
    }
  } catch (e) {
    showError('No answer from the aggregator (' + e.message + '); showing what it last said.');
    $('live').textContent = 'offline';
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function render(s) {
  $('federation').textContent = 'federation ' + s.federation + ' \u00b7 ' + s.name + ' \u00b7 ' +
      (s.mode === 'async' ? 'asynchronous' : 'synchronous') + ' rounds' +
      (s.privacy_mode === 'private' ? ' \u00b7 private (secure aggregation)' : '');
  renderProgress(s);
  renderModel(s);
  renderBytes(s);
  renderStaleness(s);
  renderUpdates(s);
  renderChart(s.history || []);
  renderSites(s.sites || []);
  renderRejections(s.recent_rejections || [], s);
}

function renderProgress(s) {
  const p = s.progress || {};
  const received = isNumber(p.received) ? p.received : 0, wanted = isNumber(p.wanted) ? p.wanted : 0;
  const box = $('progress');
  box.dataset.round = s.round;
  box.dataset.version = s.version;
  box.dataset.open = String(!!p.open);
  box.dataset.received = received;
  box.dataset.wanted = wanted;
  // Asynchronous rounds have no rounds to count: each server step is a version.
  $('round-title').textContent = s.mode === 'async' ? 'Model version' : 'Round';
  $('round-number').textContent = (s.mode === 'async' ? s.version : s.round) + (s.rounds > 0 ? ' of ' + s.rounds : '');
  let text;
  if (s.finished) text = 'finished at model version ' + s.version;
  else if (p.mode === 'async') text = received + ' of ' + wanted + ' updates buffered for the next step';
  else if (!p.open) text = 'waiting for enough sites to open round ' + (s.round + 1);
  else if (received < 0) text = 'secure aggregation among ' + wanted + ' sampled sites';
  else text = received + ' of ' + wanted + ' updates in' +
              (p.min_updates > 1 ? ' (at least ' + p.min_updates + ' by the deadline)' : '');
  $('progress-text').textContent = text;
  $('progress-fill').style.width = (s.finished ? 100 : wanted > 0 && received > 0 ? 100 * received / wanted : 0) + '%';
  tickDeadline();
}

function tickDeadline() {
  const p = latest && latest.progress;
  if (!p || !p.open || !isNumber(p.deadline_seconds_left) || latest.finished) { $('deadline').textContent = ''; return; }
  const left = Math.max(0, p.deadline_seconds_left - (Date.now() - fetchedAt) / 1000);
  $('deadline').textContent = left > 0 ? 'deadline in ' + Math.ceil(left) + ' s' : 'deadline reached';
}

function renderModel(s) {
  $('accuracy').textContent = isNumber(s.test_accuracy) ? percent(s.test_accuracy) : '\u2013';
  const parts = ['model version ' + s.version];
  if (isNumber(s.test_loss)) parts.push('test loss ' + s.test_loss.toFixed(4));
  if (!isNumber(s.test_accuracy)) parts.push('no validation yet');
  $('model-text').textContent = parts.join(' \u00b7 ');
}

function renderBytes(s) {
  const sent = s.bytes_sent, received = s.bytes_received;
  $('bytes').textContent = bytes((sent || 0) + (received || 0));
  const parts = ['received ' + bytes(received), 'sent ' + bytes(sent)];
  const h = s.history || [];
  if (h.length >= 2) {
    // Rounds from before a restart (the round log) have no byte counts.
    const a = h[h.length - 2], b = h[h.length - 1];
    if ([a.bytes_sent, a.bytes_received, b.bytes_sent, b.bytes_received].every(isNumber)) {
      parts.push('last round ' + bytes((b.bytes_sent + b.bytes_received) - (a.bytes_sent + a.bytes_received)));
    }
  }
  $('bytes-text').textContent = parts.join(' \u00b7 ');
}

function renderStaleness(s) {
  const st = s.staleness || {};
  $('staleness').textContent = isNumber(st.mean) ? st.mean.toFixed(2) : '\u2013';
  const h = s.history || [];
  const last = h.length ? h[h.length - 1].staleness || [] : [];
  $('staleness-text').textContent = 'mean over ' + (st.count || 0) + ' accepted updates' +
      (last.length ? ' \u00b7 last round max ' + Math.max(...last) : '');
  const bars = $('staleness-bars');
  clear(bars);
  const bounds = st.bounds || [], cumulative = st.cumulative_counts || [];
  const counts = bounds.map((b, i) => cumulative[i] - (i ? cumulative[i - 1] : 0));
  counts.push((st.count || 0) - (cumulative.length ? cumulative[cumulative.length - 1] : 0));
  const labels = bounds.map((b, i) => (i === 0 ? '' : '\u2264') + b).concat(['>' + (bounds[bounds.length - 1] ?? 0)]);
  const top = Math.max(1, ...counts), width = 200 / counts.length;
  counts.forEach((c, i) => {
    const height = 30 * c / top;
    const bar = svgNode('rect', {x: i * width + 2, y: 32 - height, width: width - 4, height: Math.max(height, 0.5),
                                 fill: '#93c5fd'});
    bar.appendChild(svgNode('title', {}, labels[i] + ': ' + c + ' updates'));
    bars.appendChild(bar);
    bars.appendChild(svgNode('text', {x: i * width + width / 2, y: 44, 'text-anchor': 'middle'}, labels[i]));
  });
}

function renderUpdates(s) {
  $('updates').textContent = String(s.updates_accepted);
  $('updates-text').textContent = 'updates accepted \u00b7 ' + s.rejections_total + ' messages refused \u00b7 ' +
      s.http_unauthorized + ' page requests without the token';
}

function renderChart(history) {
  const chart = $('chart');
  clear(chart);
  const W = 900, H = 200, L = 52, R = 56, T = 12, B = 36, w = W - L - R, h = H - T - B;
  const points = history.filter((p) => isNumber(p.test_accuracy) || isNumber(p.test_loss));
  chart.dataset.points = points.length;
  if (!points.length) {
    chart.appendChild(svgNode('text', {x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'empty'},
        history.length ? 'the aggregator has no validation set: nothing to chart' : 'no round finished yet'));
    return;
  }
  const rounds = points.map((p) => p.round);
  const first = Math.min(...rounds), last = Math.max(...rounds);
  const x = (r) => last === first ? L + w / 2 : L + (r - first) / (last - first) * w;
  const losses = points.filter((p) => isNumber(p.test_loss)).map((p) => p.test_loss);
  const lossTop = losses.length ? Math.max(...losses) * 1.1 || 1 : 1;
  const yAccuracy = (v) => T + (1 - v) * h;
  const yLoss = (v) => T + (1 - v / lossTop) * h;
  for (let i = 0; i <= 4; ++i) {
    const y = T + h * i / 4;
    chart.appendChild(svgNode('line', {x1: L, x2: L + w, y1: y, y2: y, class: 'grid'}));
    chart.appendChild(svgNode('text', {x: L - 6, y: y + 4, 'text-anchor': 'end'}, (100 - 25 * i) + '%'));
    chart.appendChild(svgNode('text', {x: L + w + 6, y: y + 4}, (lossTop * (1 - i / 4)).toPrecision(3)));
  }
  const step = Math.max(1, Math.ceil((last - first) / 10));
  for (let r = first; r <= last; r += step) {
    chart.appendChild(svgNode('text', {x: x(r), y: T + h + 16, 'text-anchor': 'middle'}, String(r)));
  }
  chart.appendChild(svgNode('text', {x: L + w / 2, y: H - 2, 'text-anchor': 'middle'}, 'round'));
  const radius = points.length > 100 ? 2 : 3.5;
  for (const [series, key, color, y, label, dash] of [
           ['loss', 'test_loss', '#d97706', yLoss, (v) => 'loss ' + v.toFixed(4), '5 4'],
           ['accuracy', 'test_accuracy', '#2563eb', yAccuracy, (v) => 'accuracy ' + percent(v), '']]) {
    const own = points.filter((p) => isNumber(p[key]));
    if (!own.length) continue;
    chart.appendChild(svgNode('polyline', {fill: 'none', stroke: color, 'stroke-width': 2, 'stroke-dasharray': dash,
        points: own.map((p) => x(p.round).toFixed(1) + ',' + y(p[key]).toFixed(1)).join(' ')}));
    for (const p of own) {
      const dot = svgNode('circle', {cx: x(p.round).toFixed(1), cy: y(p[key]).toFixed(1), r: radius, fill: color,
          'data-series': series, 'data-round': p.round, 'data-value': String(p[key])});
      dot.appendChild(svgNode('title', {}, 'round ' + p.round + ': ' + label(p[key])));
      chart.appendChild(dot);
    }
  }
}

function renderSites(sites) {
  const body = $('sites-body');
  clear(body);
  const counts = {};
  for (const site of sites) {
    counts[site.state] = (counts[site.state] || 0) + 1;
    const row = node('tr', {'data-site': site.site, 'data-state': site.state});
    row.appendChild(node('td', {}, site.site));
    const state = node('td');
    state.appendChild(node('span', {class: 'state state-' + (STATES.includes(site.state) ? site.state : 'dropped')},
                           site.state));
    row.appendChild(state);
    row.appendChild(node('td', {}, ago(site.last_contact_seconds)));
    row.appendChild(node('td', {class: 'num'}, String(site.accepted)));
    row.appendChild(node('td', {class: 'num'}, String(site.refused)));
    row.appendChild(node('td', {class: 'num'}, site.staleness >= 0 ? String(site.staleness) : '\u2013'));
    // Its held-out metric: accuracy, or R^2 for a regression task.
    const local = site.report_round < 0 ? '\u2013'
                : typeof site.local_r2 === 'number' ? 'R\u00b2 ' + site.local_r2.toFixed(3)
                : percent(site.local_accuracy);
    row.appendChild(node('td', {class: 'num'}, local));
    body.appendChild(row);
  }
  const summary = STATES.filter((k) => counts[k]).map((k) => counts[k] + ' ' + k).join(', ');
  $('sites-title').textContent = 'Sites (' + sites.length + (summary ? ': ' + summary : '') + ')';
}

function renderRejections(rejections, s) {
  const body = $('rejections-body');
  clear(body);
  for (const r of rejections) {
    const row = node('tr', {'data-peer': r.peer, 'data-code': r.code});
    row.appendChild(node('td', {}, clock(r.unix_ms)));
    row.appendChild(node('td', {}, r.peer));
    row.appendChild(node('td', {}, r.code));
    row.appendChild(node('td', {class: 'reason'}, r.reason));
    body.appendChild(row);
  }
  if (!rejections.length) {
    const row = node('tr');
    row.appendChild(node('td', {colspan: 4, class: 'sub'}, 'nothing refused'));
    body.appendChild(row);
  }
  const reasons = Object.entries(s.rejections_by_reason || {}).map(([k, v]) => v + ' ' + k).join(', ');
  $('rejections-title').textContent = 'Recent rejections (' + s.rejections_total + ' in all' +
      (reasons ? ': ' + reasons : '') + ')';
}

setInterval(tickDeadline, 1000);
poll();
