//! Progress bars for work measured in bytes (reading, encoding), and spinners for
//! work that cannot say how far it is. Drawn on stderr when it is a terminal, and then
//! replaced by one closing line; otherwise silent (logs keep the run's own lines, and an
//! error stays the one line on stderr).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `total` bytes, with throughput and ETA.
pub fn bytes_bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} {bar:30.cyan/blue} {bytes}/{total_bytes} {bytes_per_sec} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// Turns `bar` into one over `total` units of work from `done`, with `message`: the
/// next stage of the same work (a tokenizer's merges after its sample was read).
pub fn restage(bar: &ProgressBar, done: u64, total: u64, message: &str) {
    bar.set_style(count_style());
    bar.set_length(total);
    bar.set_position(done);
    bar.reset_eta();
    bar.set_message(message.to_string());
}

fn count_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{msg} {bar:30.cyan/blue} {pos}/{len} [{elapsed_precise} < {eta_precise}]",
    )
    .expect("a valid template")
    .progress_chars("=> ")
}

/// A bar over `total` units of work (windows, tensors), with ETA.
pub fn count_bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} {bar:30.cyan/blue} {pos}/{len} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// A spinner with a message and the time elapsed.
pub fn spinner(message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed_precise}]")
            .expect("a valid template"),
    );
    bar.set_message(message.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(250));
    bar
}

/// Ends `bar`, leaving `line` in its place on a terminal.
pub fn finish(bar: &ProgressBar, line: &str) {
    bar.finish_and_clear();
    if !bar.is_hidden() {
        eprintln!("{line}");
    }
}
