"""The CSS and JavaScript of npu-compare's HTML page (npukit/accuracy/report.py writes the page).

Kept as Python strings so the page stays one self-contained file and nothing but .py files has to
be installed with the package. The script reads one JSON blob (`<script type="application/json"
id="npukit-data">`, built by report.py's `_page_data`) and renders lazily: the module tree shows
only the children of expanded nodes, and each table puts one page of rows in the DOM. When the
first view is painted it sets `document.documentElement.dataset.ready` (and `window.npukitReady`)
to `performance.now()`: the milliseconds since navigation start.
"""

from __future__ import annotations

# Colours the browser test looks for in the screenshot: keep them in step with tests/e2e.
DIVERGED_BACKGROUND = "#ffd84d"  # the first-divergence node of the module tree

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} .err{color:#c0392b} .warn{color:#b9770e} .pass{color:#1e8449} .unmatched{color:#8e44ad}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:3px 6px;text-align:left}
td{max-width:520px;overflow-wrap:anywhere}
th{background:#f4f4f4;cursor:pointer;position:sticky;top:0;white-space:nowrap} tr.first{background:#fdecea}
th.asc::after{content:" \\25B2";font-size:9px} th.desc::after{content:" \\25BC";font-size:9px}
.box{border:1px solid #e74c3c;background:#fdf2f0;padding:8px 12px;margin:12px 0}
.ok{border:1px solid #27ae60;background:#eefaf1;padding:8px 12px;margin:12px 0}
.note{color:#555;font-size:13px;margin:4px 0}
pre{white-space:pre-wrap;font-size:12px;margin:4px 0}
.toolbar{margin:8px 0;display:flex;gap:14px;align-items:center;flex-wrap:wrap}
.model{display:flex;gap:16px;align-items:flex-start}
#tree{flex:0 0 520px;max-height:640px;overflow:auto;border:1px solid #ddd;padding:6px;font-size:13px}
#node-ops{flex:1 1 auto;min-width:0;overflow:auto} #node-ops td{white-space:nowrap}
ul.tree,ul.tree ul{list-style:none;margin:0;padding-left:16px} ul.tree{padding-left:0}
.label{cursor:pointer;padding:1px 4px;border-left:4px solid transparent;white-space:nowrap;border-radius:2px}
.label:hover{background:#f0f3f5}
.v-err>.label{border-left-color:#c0392b;background:#fdecea} .v-warn>.label{border-left-color:#e0a800;background:#fef5e7}
.v-unmatched>.label{border-left-color:#8e44ad;background:#f5eef8} .v-pass>.label{border-left-color:#27ae60}
.v-err>.label:hover,.v-warn>.label:hover,.v-unmatched>.label:hover{filter:brightness(0.97)}
.label.selected{outline:2px solid #34495e}
li>.label.diverged{background:""" + DIVERGED_BACKGROUND + """;border-left-color:#e74c3c;font-weight:bold}
.twisty{display:inline-block;width:14px;color:#555} .cls{color:#777;font-size:11px} .meta{color:#555;font-size:11px}
.badge{font-size:10px;padding:0 4px;border-radius:3px;margin-left:4px;color:#fff;background:#e74c3c}
.badge.fix{background:#2471a3}
.more{color:#2471a3;cursor:pointer;font-size:12px;padding-left:18px}
.fixbox{border:1px solid #2471a3;background:#eef5fb;padding:8px 12px;margin:8px 0}
.pager{margin:4px 0;font-size:12px} .pager button{margin:0 2px}
"""

# The JSON blob (report.py's _page_data): "columns" [{name, kind}], "strings" (the string table),
# "rows" (one array per row: a cell per column -- a string index for kind "text", [entry, suffix]
# string indices or one index for "name", a verdict index for "verdict", a number or the CSV's text
# for "num" -- then the row's tree node, -1 for none, and 1 if it is a first-divergent op's row),
# "nodes" [{pair, parent, label, cls, path, counts, worst, max_error}], "pairs" [{label, mode, note,
# roots, divergence_node, fix_node}], "fixes" [{node, pair, summary, code, details, names}], "start_pair".
JS = r"""
(function () {
'use strict';
var D = JSON.parse(document.getElementById('npukit-data').textContent);
var S = D.strings, R = D.rows, N = D.nodes, P = D.pairs, COLS = D.columns;
var VERDICTS = ['error', 'warn', 'unmatched', 'pass'], VCSS = ['err', 'warn', 'unmatched', 'pass'];
var ORDER = COLS.findIndex(function (c) { return c.name === 'Order'; });
var VERDICT = COLS.findIndex(function (c) { return c.kind === 'verdict'; });
var NODE = COLS.length, FIRST = COLS.length + 1, PAGE = 200, CHILDREN_SHOWN = 200;
var shown = [true, true, true, true];

function esc(text) {
  return String(text).replace(/[&<>"']/g, function (c) {
    return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c];
  });
}
function cellText(row, c) {
  var v = row[c], kind = COLS[c].kind;
  if (kind === 'text') return v == null ? '' : S[v];
  if (kind === 'name') return typeof v === 'number' ? S[v] : S[v[0]] + '.' + S[v[1]];
  if (kind === 'verdict') return VERDICTS[v];
  return v == null ? '' : String(v);
}
function sortKey(row, c) {
  var v = row[c], kind = COLS[c].kind;
  if (kind === 'text') return v == null ? '' : S[v];
  if (kind === 'name') return cellText(row, c);
  if (kind === 'verdict' || typeof v === 'number') return v;
  if (v == null) return null;
  if (v === 'inf') return Infinity;
  if (v === '-inf') return -Infinity;
  var f = parseFloat(v);
  return isNaN(f) ? null : f;  // nan, unsupported: after the numbers, either direction
}
function fmtError(v) { return typeof v === 'number' ? v.toPrecision(3).replace(/\.?0+(e|$)/, '$1') : String(v); }

// ------------------------------------------------------------------ tables: sortable, paged
function Table(host, defaultSort) {
  this.host = host; this.base = []; this.rows = []; this.page = 0;
  this.sortCol = defaultSort; this.asc = true; this.defaultSort = defaultSort;
  host.innerHTML = '<div class="pager"></div><table class="sortable"><thead><tr>' +
    COLS.map(function (c, i) { return '<th data-col="' + i + '">' + esc(c.name) + '</th>'; }).join('') +
    '</tr></thead><tbody></tbody></table><div class="pager"></div>';
  this.table = host.querySelector('table');
  this.pagers = host.querySelectorAll('.pager');
  var self = this;
  this.table.tHead.addEventListener('click', function (event) {
    var th = event.target.closest('th');
    if (th) self.sortBy(+th.dataset.col);
  });
  host.addEventListener('click', function (event) {
    var button = event.target.closest('.pager button');
    if (!button) return;
    var last = Math.max(0, Math.ceil(self.rows.length / PAGE) - 1);
    self.page = Math.min(last, Math.max(0, {first: 0, prev: self.page - 1, next: self.page + 1, last: last}[button.dataset.go]));
    self.render();
  });
}
Table.prototype.setRows = function (indices) {
  this.base = indices; this.sortCol = this.defaultSort; this.asc = true; this.apply();
};
Table.prototype.apply = function () {
  this.rows = this.base.filter(function (i) { return shown[R[i][VERDICT]]; });
  if (this.sortCol != null) this.sortRows();
  this.page = 0; this.render();
};
Table.prototype.sortBy = function (col) {
  this.asc = this.sortCol === col ? !this.asc : true;
  this.sortCol = col; this.sortRows(); this.page = 0; this.render();
};
Table.prototype.sortRows = function () {
  var col = this.sortCol, sign = this.asc ? 1 : -1, keys = new Map();
  this.rows.forEach(function (i) { keys.set(i, sortKey(R[i], col)); });
  this.rows.sort(function (a, b) {
    var x = keys.get(a), y = keys.get(b);
    if (x === y) return a - b;
    if (x === null || (typeof x === 'number' && isNaN(x))) return 1;
    if (y === null || (typeof y === 'number' && isNaN(y))) return -1;
    return (x < y ? -1 : 1) * sign;
  });
};
Table.prototype.render = function () {
  var start = this.page * PAGE, slice = this.rows.slice(start, start + PAGE), html = [];
  for (var k = 0; k < slice.length; k++) {
    var row = R[slice[k]], cells = [];
    for (var c = 0; c < COLS.length; c++) {
      cells.push(c === VERDICT ? '<td class="' + VCSS[row[c]] + '">' + VERDICTS[row[c]] + '</td>'
                               : '<td>' + esc(cellText(row, c)) + '</td>');
    }
    html.push('<tr' + (row[FIRST] ? ' class="first"' : '') + '>' + cells.join('') + '</tr>');
  }
  this.table.tBodies[0].innerHTML = html.join('');
  var col = this.sortCol, asc = this.asc;
  this.table.querySelectorAll('th').forEach(function (th, i) {
    th.className = i === col ? (asc ? 'asc' : 'desc') : '';
  });
  var total = this.rows.length, text = total ? 'rows ' + (start + 1) + '\u2013' + (start + slice.length) + ' of ' + total
                                              : 'no rows' + (this.base.length ? ' (filtered out)' : '');
  if (this.base.length !== total) text += ', ' + (this.base.length - total) + ' hidden by the verdict filter';
  var buttons = total > PAGE ? ' <button data-go="first">\u00ab</button><button data-go="prev">\u2039</button>' +
                               '<button data-go="next">\u203a</button><button data-go="last">\u00bb</button>' : '';
  this.pagers.forEach(function (p, i) { p.innerHTML = i === 0 || total > PAGE ? esc(text) + buttons : ''; });
};

// ------------------------------------------------------------------ the module tree
var children = N.map(function () { return []; }), own = N.map(function () { return []; });
N.forEach(function (n, i) { if (n.parent >= 0) children[n.parent].push(i); });
for (var i = 0; i < R.length; i++) { if (R[i][NODE] >= 0) own[R[i][NODE]].push(i); }
var fixes = {};
(D.fixes || []).forEach(function (f) { if (f.node >= 0) (fixes[f.node] = fixes[f.node] || []).push(f); });
var expanded = new Set(), childLimit = {}, selected = -1, pairIndex = 0;
var treeHost = document.getElementById('tree'), opsHost = document.getElementById('node-ops');
var opsTable = null;

function nodeVisible(id) {
  var c = N[id].counts;
  return c.some(function (count, v) { return shown[v] && count > 0; }) || (fixes[id] && true) || false;
}
function diverged(id) { return P[N[id].pair].divergence_node === id; }
function labelHtml(id) {
  var n = N[id], kids = children[id].length, c = n.counts;
  var twisty = kids ? (expanded.has(id) ? '\u25be' : '\u25b8') : '\u00b7';
  var counts = VERDICTS.map(function (v, k) { return c[k] ? c[k] + ' ' + v : ''; }).filter(Boolean).join(', ');
  return '<span class="twisty">' + twisty + '</span><span class="name">' + esc(S[n.label]) + '</span> ' +
    (n.cls >= 0 ? '<span class="cls">' + esc(S[n.cls]) + '</span> ' : '') +
    '<span class="meta">' + esc(counts) + (n.max_error != null ? '; max rel. L2 ' + esc(fmtError(n.max_error)) : '') + '</span>' +
    (diverged(id) ? '<span class="badge">first divergence</span>' : '') +
    (fixes[id] ? '<span class="badge fix">fix</span>' : '');
}
function nodeElement(id) {
  var li = document.createElement('li'), label = document.createElement('div');
  li.className = 'node v-' + (N[id].worst >= 0 ? VCSS[N[id].worst] : 'none');
  li.dataset.node = id;
  label.className = 'label' + (diverged(id) ? ' diverged' : '') + (id === selected ? ' selected' : '');
  label.title = S[N[id].path];
  label.innerHTML = labelHtml(id);
  li.appendChild(label);
  if (expanded.has(id) && children[id].length) li.appendChild(childList(id));
  return li;
}
function childList(id) {
  var ul = document.createElement('ul'), kids = children[id].filter(nodeVisible), limit = childLimit[id] || CHILDREN_SHOWN;
  kids.slice(0, limit).forEach(function (k) { ul.appendChild(nodeElement(k)); });
  if (kids.length > limit) {
    var more = document.createElement('li');
    more.className = 'more'; more.dataset.more = id;
    more.textContent = '\u2026 ' + (kids.length - limit) + ' more modules';
    ul.appendChild(more);
  }
  return ul;
}
function renderTree() {
  if (!treeHost) return;
  var ul = document.createElement('ul');
  ul.className = 'tree';
  P[pairIndex].roots.filter(nodeVisible).forEach(function (id) { ul.appendChild(nodeElement(id)); });
  if (!ul.children.length) {
    ul.innerHTML = '<li class="note">' + (P[pairIndex].roots.length ? 'no module has rows of the verdicts shown'
                                                                    : 'no module tree for this step/rank') + '</li>';
  }
  treeHost.replaceChildren(ul);
}
function redrawNode(id) {
  var li = treeHost.querySelector('li[data-node="' + id + '"]');
  if (li) li.replaceWith(nodeElement(id));
}
function subtreeRows(id) {
  var rows = [], stack = [id];
  while (stack.length) { var n = stack.pop(); rows.push.apply(rows, own[n]); stack.push.apply(stack, children[n]); }
  return rows;
}
function select(id) {
  var previous = selected;
  selected = id;
  if (previous >= 0) {
    var old = treeHost.querySelector('li[data-node="' + previous + '"] > .label');
    if (old) old.classList.remove('selected');
  }
  var label = treeHost.querySelector('li[data-node="' + id + '"] > .label');
  if (label) label.classList.add('selected');
  renderOps();
}
function renderOps() {
  if (!opsHost) return;
  if (selected < 0) {
    opsHost.innerHTML = '<p class="note">Click a module to see its ops and their metrics.</p>';
    opsTable = null;
    return;
  }
  var n = N[selected], withSubtree = document.getElementById('with-submodules');
  var subtree = withSubtree ? withSubtree.checked : false;
  var rows = subtree ? subtreeRows(selected) : own[selected].slice();
  var head = '<h3 id="node-title">' + esc(S[n.path]) + (n.cls >= 0 ? ' <span class="cls">' + esc(S[n.cls]) + '</span>' : '') + '</h3>' +
    '<p class="note">' + (subtree ? 'the ops of this module and of its sub-modules' :
      'the ops this module runs itself and its own inputs/outputs (tick the box above for its sub-modules\' too)') + '</p>';
  (fixes[selected] || []).forEach(function (f) {
    head += '<div class="fixbox"><b>Proposed fix:</b> ' + esc(f.summary || '') +
      (f.details ? '<br>' + esc(f.details) : '') + (f.code ? '<pre class="fixcode">' + esc(f.code) + '</pre>' : '') + '</div>';
  });
  opsHost.innerHTML = head + '<div id="node-table"></div>';
  opsTable = new Table(document.getElementById('node-table'), ORDER);
  opsTable.setRows(rows);
}
function openPath(id) {
  // expand every ancestor, and list each one's children far enough to show the path's child
  for (var child = id, n = N[id].parent; n >= 0; child = n, n = N[n].parent) {
    expanded.add(n);
    var at = children[n].filter(nodeVisible).indexOf(child);
    if (at >= (childLimit[n] || CHILDREN_SHOWN)) childLimit[n] = at + 1;
  }
}
function scrollToNode(id) {  // inside the tree's own box: the page itself stays where it is
  var label = treeHost.querySelector('li[data-node="' + id + '"] > .label');
  if (label) treeHost.scrollTop += label.getBoundingClientRect().top - treeHost.getBoundingClientRect().top - treeHost.clientHeight / 3;
}
function showPair(index) {
  pairIndex = index;
  var pair = P[index], start = pair.divergence_node;
  expanded = new Set(); childLimit = {};
  if (start < 0) start = pair.fix_node;
  (D.fixes || []).forEach(function (f) { if (f.pair === index && f.node >= 0) openPath(f.node); });  // every module a fix names
  if (start >= 0) openPath(start);
  selected = start;
  var note = document.getElementById('tree-note');
  if (note) note.textContent = pair.note;
  renderTree();
  renderOps();
  if (start >= 0) scrollToNode(start);
}

if (treeHost) {
  treeHost.addEventListener('click', function (event) {
    var more = event.target.closest('.more');
    if (more) {
      var parent = +more.dataset.more;
      childLimit[parent] = (childLimit[parent] || CHILDREN_SHOWN) + CHILDREN_SHOWN;
      redrawNode(parent);
      return;
    }
    var label = event.target.closest('.label');
    if (!label) return;
    var id = +label.parentNode.dataset.node;
    if (event.target.closest('.twisty')) {
      if (expanded.has(id)) expanded.delete(id); else expanded.add(id);
      redrawNode(id);
      return;
    }
    if (!expanded.has(id) && children[id].length) { expanded.add(id); redrawNode(id); }
    select(id);
  });
  var pairSelect = document.getElementById('pair-select');
  if (pairSelect) pairSelect.addEventListener('change', function () { showPair(+pairSelect.value); });
  var withSubtree = document.getElementById('with-submodules');
  if (withSubtree) withSubtree.addEventListener('change', renderOps);
}

var allTable = new Table(document.getElementById('all-rows'), null);
allTable.setRows(R.map(function (_, k) { return k; }));
document.querySelectorAll('input.verdict').forEach(function (box) {
  box.addEventListener('change', function () {
    shown[+box.dataset.verdict] = box.checked;
    allTable.apply();
    if (opsTable) opsTable.apply();
    if (treeHost) renderTree();
  });
});
if (treeHost) showPair(D.start_pair);

// ready: the first view is laid out and painted
requestAnimationFrame(function () {
  setTimeout(function () {
    var now = performance.now();
    window.npukitReady = now;
    document.documentElement.dataset.ready = now.toFixed(1);
  }, 0);
});
})();
"""
