//! Progress bars for work measured in bytes (reading, encoding), and spinners for
//! work that cannot say how far it is. Drawn on stderr when it is a terminal, and then
//! replaced by one closing line. Where stderr is a file or a pipe (a cluster job's log,
//! `2>&1 | tee`), work that lasts writes the bar as a plain line after 5 s, then every
//! `TINYGPT_PROGRESS_SECONDS` (30; 0: never), so hours of data preparation do not look
//! hung; shorter work writes nothing (an error stays the one line on stderr).

use std::io::{IsTerminal, Write as _};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

/// Where bars draw: the terminal, else a line now and then (see the module's comment).
fn stderr_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        return ProgressDrawTarget::stderr_with_hz(4);
    }
    match log_every() {
        Some(every) => ProgressDrawTarget::term_like_with_hz(Box::new(LogLines::new(every)), 4),
        None => ProgressDrawTarget::hidden(),
    }
}

/// `TINYGPT_PROGRESS_SECONDS`: how often a bar writes its line to a log; None for never.
fn log_every() -> Option<Duration> {
    let seconds = match std::env::var("TINYGPT_PROGRESS_SECONDS") {
        Ok(text) => text.trim().parse::<f64>().ok().filter(|s| s.is_finite())?,
        Err(_) => 30.0,
    };
    (seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

/// How long work goes before its first line in a log, at most.
const FIRST_LINE_AFTER: Duration = Duration::from_secs(5);

/// A terminal that is a log: of what the bar draws, the latest line is written once
/// [`FIRST_LINE_AFTER`] (or `every`, if shorter) has passed since the bar began, and
/// again each `every` after.
#[derive(Debug)]
struct LogLines {
    every: Duration,
    next: Mutex<Instant>,
}

impl LogLines {
    fn new(every: Duration) -> Self {
        Self {
            every,
            next: Mutex::new(Instant::now() + every.min(FIRST_LINE_AFTER)),
        }
    }

    fn offer(&self, line: &str) -> std::io::Result<()> {
        let line = line.trim();
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if line.is_empty() || now < *next {
            return Ok(());
        }
        *next = now + self.every;
        // A log that cannot be written loses its progress lines, not the work.
        let _ = writeln!(std::io::stderr(), "{line}");
        Ok(())
    }
}

impl TermLike for LogLines {
    fn width(&self) -> u16 {
        120
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, line: &str) -> std::io::Result<()> {
        self.offer(line)
    }
    fn write_str(&self, text: &str) -> std::io::Result<()> {
        self.offer(text)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `bar` should close with a line: on a terminal always; in a log only after
/// work long enough to have written progress lines there.
fn speaks(bar: &ProgressBar) -> bool {
    if std::io::stderr().is_terminal() {
        return !bar.is_hidden();
    }
    log_every().is_some_and(|every| bar.elapsed() >= every.min(FIRST_LINE_AFTER))
}

/// A bar over `total` bytes, with throughput and ETA.
pub fn bytes_bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), stderr_target());
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
    // Changed out of sight: each setter draws, and a log would keep a line of the old
    // stage's position over the new one's length.
    bar.set_draw_target(ProgressDrawTarget::hidden());
    bar.set_style(count_style());
    bar.set_length(total);
    bar.set_position(done);
    bar.reset_eta();
    bar.set_message(message.to_string());
    bar.set_draw_target(stderr_target());
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
    let bar = ProgressBar::with_draw_target(Some(total), stderr_target());
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
    let bar = ProgressBar::with_draw_target(None, stderr_target());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed_precise}]")
            .expect("a valid template"),
    );
    bar.set_message(message.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(250));
    bar
}

/// Ends `bar`, leaving `line` in its place on a terminal (and in a log that heard
/// the bar's progress).
pub fn finish(bar: &ProgressBar, line: &str) {
    let speak = speaks(bar);
    bar.finish_and_clear();
    if speak {
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}
