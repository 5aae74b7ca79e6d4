//! The web page at `/`: a playground that streams completions, and a dashboard of the
//! runs under `--runs`. Plain HTML, CSS and JavaScript compiled into the binary (no
//! build step); charts by uPlot (MIT, vendored with its licence beside it).

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::Shared;

fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse + Clone {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

pub fn routes() -> Router<Shared> {
    let html = file(
        "text/html; charset=utf-8",
        include_str!("assets/index.html"),
    );
    let js = file(
        "text/javascript; charset=utf-8",
        include_str!("assets/app.js"),
    );
    let css = file("text/css; charset=utf-8", include_str!("assets/style.css"));
    let uplot_js = file(
        "text/javascript; charset=utf-8",
        include_str!("assets/uplot.min.js"),
    );
    let uplot_css = file(
        "text/css; charset=utf-8",
        include_str!("assets/uplot.min.css"),
    );
    let licence = file(
        "text/plain; charset=utf-8",
        include_str!("assets/uplot-LICENSE"),
    );
    Router::new()
        .route("/", get(move || async move { html.clone() }))
        .route("/app.js", get(move || async move { js.clone() }))
        .route("/style.css", get(move || async move { css.clone() }))
        .route(
            "/uplot.min.js",
            get(move || async move { uplot_js.clone() }),
        )
        .route(
            "/uplot.min.css",
            get(move || async move { uplot_css.clone() }),
        )
        .route(
            "/uplot-LICENSE",
            get(move || async move { licence.clone() }),
        )
}
