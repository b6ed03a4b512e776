// The aggregator's operator dashboard: one self-contained HTML page, written
// in aggregator/dashboard/ (dashboard.html, .css, .js) and put together at
// build time by embed_page.py (inline CSS and JavaScript, the chart an inline
// SVG drawn by the script; no fonts,
// scripts or images from anywhere, so it works on a network with no way
// out, and the endpoint's Content-Security-Policy forbids them anyway).
//
// Read-only. It polls `status` (the aggregator's /status, relative to the
// page) every 2 seconds and shows the federation's sites and their state,
// the round and its progress, accuracy and loss per round as a chart, bytes
// moved, staleness, and the recent rejections with their reasons. Opened as
// /dashboard?token=TOKEN it sends the token as `Authorization: Bearer` and
// keeps it in the tab's sessionStorage, off the address bar.
//
// What the tests read back from the rendered page (tests/cli/
// test_dashboard.cpp) is marked with data attributes: each site row
// `tr[data-site][data-state]`, each chart point
// `circle[data-series=accuracy|loss][data-round][data-value]`, the round
// `#progress[data-round][data-received][data-wanted]`.
#pragma once

#include <string_view>

namespace fedmesh::aggregator {

// The page, as served at /dashboard. Untrusted text (site names, rejection
// reasons) reaches it only through textContent and setAttribute, never as
// markup.
std::string_view dashboard_page();

}  // namespace fedmesh::aggregator
