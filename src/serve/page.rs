//! The web page at `/`: a playground that streams completions, and a dashboard of the
//! runs under `--runs`. Plain HTML, CSS and JavaScript compiled into the binary (no
//! build step); charts by uPlot (MIT, vendored with its licence beside it).

use axum::http::header;
use axum::routing::get;
use axum::Router;

use super::Shared;

/// The page's files: (path, content type, contents).
const FILES: [(&str, &str, &str); 6] = [
    (
        "/",
        "text/html; charset=utf-8",
        include_str!("assets/index.html"),
    ),
    (
        "/app.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/app.js"),
    ),
    (
        "/style.css",
        "text/css; charset=utf-8",
        include_str!("assets/style.css"),
    ),
    (
        "/uplot.min.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/uplot.min.js"),
    ),
    (
        "/uplot.min.css",
        "text/css; charset=utf-8",
        include_str!("assets/uplot.min.css"),
    ),
    (
        "/uplot-LICENSE",
        "text/plain; charset=utf-8",
        include_str!("assets/uplot-LICENSE"),
    ),
];

/// Whether `path` is one of the page's files.
pub fn is_page(path: &str) -> bool {
    FILES.iter().any(|(p, _, _)| *p == path)
}

pub fn routes() -> Router<Shared> {
    FILES
        .into_iter()
        .fold(Router::new(), |router, (path, content_type, body)| {
            let headers = [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, "no-cache"),
            ];
            router.route(path, get(move || async move { (headers, body) }))
        })
}
