//! `tinygpt serve`: a trained model behind OpenAI's HTTP API, and a web page.
//!
//! Two halves meet at a channel. The HTTP side (axum on tokio: `routes`) checks each
//! request (`openai`, `chat`), tokenizes it and hands a [`batcher::Job`] over; errors
//! are OpenAI's error JSON (`error`): 4xx for a request's mistakes, 503 while the model
//! loads, when the queue is full or when the server is stopping, decided before any
//! stream opens. The
//! decoding side (`batcher`) is one thread that owns the model and decodes every
//! running request together, token by token (continuous batching), sending each
//! request its text as it is decoded. `conn` holds connections to their deadlines and
//! to --max-connections; `metrics` counts for `/metrics`; `runs` reads
//! run folders for the page's dashboard; `page` is the page itself; `log` writes one
//! stderr line per request.
//!
//! The listener binds before the model loads (`/health` says 503 until it is ready);
//! the address is printed once requests can be served. Ctrl-C or SIGTERM: accepting
//! stops, running requests end at the next token (finish "length"), queued ones get
//! 503, and the process exits 130 / 143.

pub mod batcher;
pub mod chat;
mod conn;
pub mod error;
mod log;
pub mod metrics;
pub mod openai;
mod page;
mod routes;
pub mod runs;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Result;
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::cpu::{FastDecoder, KvPrecision, WeightFormat};
use crate::tokenizer::Tokenizer;
use crate::util::Stop;
use metrics::Metrics;

/// How the server is set up (`tinygpt serve`'s flags).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub checkpoint: PathBuf,
    pub host: String,
    pub port: u16,
    /// Sequences decoded at once.
    pub parallel: usize,
    /// Requests waiting for slots before new ones get 503.
    pub max_queue: usize,
    pub max_tokens: usize,
    pub api_key: Option<String>,
    pub cors: Option<String>,
    pub runs: Option<PathBuf>,
    /// cpu, cuda[:N] or auto (a GPU where the build and machine have one).
    pub device: String,
    pub format: WeightFormat,
    /// How the CPU decoder holds its keys and values; `None`: as goes with `format`
    /// (`KvPrecision::for_weights`). The CUDA decoder keeps its own.
    pub kv: Option<KvPrecision>,
    pub max_body_bytes: usize,
    /// Seconds a connection may sit without sending a request.
    pub idle_timeout: u64,
    pub max_connections: usize,
}

/// What the handlers share.
pub type Shared = Arc<AppState>;

pub struct AppState {
    pub options: ServeOptions,
    /// The id `/v1/models` lists: the run folder's name.
    pub model_id: String,
    pub created: u64,
    pub metrics: Arc<Metrics>,
    /// Set once the model is loaded.
    pub ready: OnceLock<Ready>,
    pub stop: Stop,
    /// The dashboard's run summaries, kept between calls.
    pub dashboard: runs::Dashboard,
}

/// The loaded model, as the handlers see it.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub block_size: usize,
    pub vocab_size: usize,
    pub parameters: usize,
    /// Where it decodes, in words.
    pub place: String,
    pub jobs: std::sync::mpsc::Sender<batcher::Job>,
}

/// `--cors`'s origin as browsers send it: `scheme://host[:port]`, nothing else (a
/// value that is no valid header would be answered as `null`, which browsers match
/// against sandboxed pages), or `*`.
fn check_origin(origin: &str) -> Result<()> {
    let valid = origin == "*"
        || origin.split_once("://").is_some_and(|(scheme, rest)| {
            matches!(scheme, "http" | "https")
                && !rest.is_empty()
                && rest
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
        });
    if !valid {
        crate::user_bail!(
            "--cors {origin:?} is not an origin; pass one as browsers send it, e.g. --cors http://localhost:3000 (scheme, host and port, no path), or *"
        );
    }
    Ok(())
}

/// Serves until a signal asks to stop; returns the stop as an error (exit 128 + signal),
/// or a load failure.
pub fn serve(options: ServeOptions, stop: Stop) -> Result<()> {
    if options.parallel == 0 || options.parallel > 1024 {
        crate::user_bail!("--parallel {} must be 1 to 1024", options.parallel);
    }
    if options.max_connections == 0 {
        crate::user_bail!(
            "--max-connections 0 would close every connection; pass 1 or more (default 512)"
        );
    }
    if options.max_body_bytes < 64 {
        crate::user_bail!(
            "--max-body-bytes {} leaves no room for a request; pass at least 64 (default 1048576)",
            options.max_body_bytes
        );
    }
    if let Some(origin) = &options.cors {
        check_origin(origin)?;
    }
    if !options.checkpoint.is_dir() {
        crate::user_bail!(
            "--checkpoint {}: no such run folder; pass one under checkpoints/ (tinygpt train writes them)",
            options.checkpoint.display()
        );
    }
    if let Some(runs) = &options.runs {
        if !runs.is_dir() {
            crate::user_bail!(
                "--runs {}: no such folder; pass the folder that holds run folders (checkpoints/)",
                runs.display()
            );
        }
    }
    let address = format!("{}:{}", options.host, options.port);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&address))
        .map_err(|e| {
            crate::error::user_error(format!(
                "cannot listen on {address}: {e}; pick another --port or --host"
            ))
        })?;
    let bound = listener.local_addr()?;
    let model_id = options
        .checkpoint
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "tinygpt".into());
    let state = Arc::new(AppState {
        model_id,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        metrics: Arc::new(Metrics::default()),
        ready: OnceLock::new(),
        stop: stop.clone(),
        dashboard: runs::Dashboard::default(),
        options,
    });

    // The model loads and decodes on its own thread; the HTTP side answers meanwhile.
    let (loaded_tx, loaded_rx) = std::sync::mpsc::channel::<Result<()>>();
    let decoding = {
        let state = Arc::clone(&state);
        std::thread::Builder::new()
            .name("decoding".into())
            .spawn(move || decode_thread(&state, loaded_tx))?
    };
    let app = routes::router(Arc::clone(&state));
    let server = runtime.spawn(accept(listener, app, Arc::clone(&state)));

    match loaded_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            stop.request(15);
            let _ = runtime.block_on(server);
            return Err(e);
        }
        // The thread ended before saying (a stop during loading).
        Err(_) => {}
    }
    if let Some(ready) = state.ready.get() {
        crate::errln!(
            "serving {} ({:.2}M parameters, {} sequences at once, {}) at http://{bound}/  (OpenAI API under /v1; Ctrl-C stops)",
            state.model_id,
            ready.parameters as f64 / 1e6,
            state.options.parallel,
            ready.place,
        );
        if !bound.ip().is_loopback() && state.options.api_key.is_none() {
            crate::errln!(
                "note: this answers anyone who can reach port {} of this machine, with no key asked: give --api-key KEY (or TINYGPT_API_KEY) to ask for one, or --host 127.0.0.1 to serve this machine alone",
                bound.port()
            );
        }
    }
    let _ = runtime.block_on(server);
    let _ = decoding.join();
    runtime.shutdown_timeout(Duration::from_secs(1));
    let signal = stop.signal().unwrap_or(15);
    Err(crate::util::Stopped { signal }.into())
}

/// Loads the model, says so, then runs the decoding loop until the stop.
fn decode_thread(state: &AppState, loaded: std::sync::mpsc::Sender<Result<()>>) {
    let options = &state.options;
    let opened = match open(options) {
        Ok(opened) => opened,
        Err(e) => {
            let _ = loaded.send(Err(e));
            return;
        }
    };
    let Opened {
        mut decoder,
        tokenizer,
        spec,
        place,
    } = opened;
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel();
    let _ = state.ready.set(Ready {
        tokenizer: Arc::clone(&tokenizer),
        block_size: spec.config.block_size,
        vocab_size: spec.config.vocab_size,
        parameters: spec.len(),
        place,
        jobs: jobs_tx,
    });
    let _ = loaded.send(Ok(()));
    batcher::run(
        &mut *decoder,
        &tokenizer,
        jobs_rx,
        &state.metrics,
        &state.stop,
    );
}

/// Hands freed memory back to the system after a large request (glibc keeps what a
/// request's many small allocations freed; elsewhere nothing is done).
pub(crate) fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // Safety: malloc_trim only releases free memory; it may be called at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The model, ready to decode on the thread that opened it.
struct Opened {
    decoder: Box<dyn batcher::RowModel>,
    tokenizer: Arc<Tokenizer>,
    spec: crate::model::ModelSpec,
    place: String,
}

/// Opens the checkpoint for the decoder `--device` asks for: the CUDA decoder on a GPU
/// (where the build and machine have one and its first-use check passes), else the
/// fused CPU decoder over the mapped checkpoint.
fn open(options: &ServeOptions) -> Result<Opened> {
    let auto = crate::device::is_auto(&options.device);
    if options.format.is_integer() && !auto && !options.device.eq_ignore_ascii_case("cpu") {
        crate::user_bail!(
            "--dtype {} decodes on the CPU only; use --device cpu, or --dtype f32 / bf16 on a GPU",
            options.format.name()
        );
    }
    #[cfg(feature = "cuda-emulator")]
    if std::env::var_os("TINYGPT_EMULATE_CUDA").is_some_and(|v| v == "1") {
        return open_cuda(
            options,
            "the CUDA decoder under the CPU emulator",
            |spec, values, batch, precision| {
                crate::cuda::CudaDecoder::emulated(spec, values, batch, precision)
            },
        );
    }
    let gpu = match auto {
        true if !options.format.is_integer() => crate::device::first_cuda(),
        true => None,
        false => Some(crate::device::parse_device(&options.device)?).filter(|d| !d.is_cpu()),
    };
    if let Some(device) = gpu {
        if !device.is_cuda() {
            crate::user_bail!(
                "--device {}: serve decodes on the CPU or a CUDA GPU",
                options.device
            );
        }
        if options.kv.is_some() {
            crate::user_bail!(
                "--kv-dtype sets the CPU decoder's keys and values; the CUDA decoder keeps its own: drop it, or pass --device cpu"
            );
        }
        // Where the fused CUDA code failed its first-use check, that is said in one
        // line and the CPU decodes.
        #[cfg(feature = "cuda")]
        match crate::engine::first_use_failure(Some(&device))? {
            Some(line) => crate::errln!("{line}"),
            None => {
                let place = format!("CUDA {}", crate::device::name(&device));
                return open_cuda(options, &place, |spec, values, batch, precision| {
                    crate::cuda::CudaDecoder::new(spec, values, &device, batch, precision)
                });
            }
        }
    }
    let mut opened = crate::mapped::open_for_decoding(
        &options.checkpoint,
        options.format,
        crate::mapped::Hold::Streamed,
    )?;
    opened.verification.wait()?;
    let kv = options
        .kv
        .unwrap_or(KvPrecision::for_weights(options.format));
    let decoder = FastDecoder::with_kv(Arc::clone(&opened.weights), options.parallel, kv)?;
    Ok(Opened {
        spec: decoder.spec().clone(),
        decoder: Box::new(decoder),
        tokenizer: Arc::new(opened.tokenizer),
        place: format!(
            "the CPU, {} weights, {} keys and values",
            options.format.name(),
            kv.name()
        ),
    })
}

/// The checkpoint loaded and laid out for a CUDA decoder that `make` builds.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
fn open_cuda(
    options: &ServeOptions,
    place: &str,
    make: impl FnOnce(
        &crate::model::ModelSpec,
        &[f32],
        usize,
        crate::config::Precision,
    ) -> Result<crate::cuda::CudaDecoder>,
) -> Result<Opened> {
    use crate::config::Precision;
    let precision = match options.format {
        WeightFormat::Bf16 => Precision::Bf16,
        _ => Precision::F32,
    };
    let loaded = crate::checkpoint::Loaded::load_with(
        &options.checkpoint,
        &candle_core::Device::Cpu,
        Precision::F32,
    )?;
    let values = loaded.model.params().to_flat()?;
    let spec = loaded.model.spec().clone();
    let decoder = make(&spec, &values, options.parallel, precision)?;
    Ok(Opened {
        decoder: Box::new(decoder),
        tokenizer: Arc::new(loaded.tokenizer),
        spec,
        place: format!("{place}, {}", options.format.name()),
    })
}

/// Accepts connections until the stop, then lets the open ones finish (a few seconds
/// at most: running requests end at their next token; connections that only wait on
/// their clients are closed at once).
async fn accept(listener: tokio::net::TcpListener, app: axum::Router, state: Arc<AppState>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let connections = conn::Connections::new(state.options.max_connections);
    let idle = Duration::from_secs(state.options.idle_timeout);
    let deadlines = conn::Deadlines::new(idle);
    let stopped = {
        let stop = state.stop.clone();
        async move {
            while stop.signal().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)): std::io::Result<(tokio::net::TcpStream, SocketAddr)> = accepted else {
                    // Out of file descriptors and the like: breathe, then go on.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                // Over the connection limit with every connection being answered:
                // closed at once.
                let Some(admitted) = connections.admit() else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let service = conn::service(app.clone(), Arc::clone(&admitted.conn), deadlines);
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    // Also bounds how long an idle kept-alive connection stays open.
                    .header_read_timeout(idle)
                    .serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    tokio::select! {
                        _ = connection => {}
                        () = admitted.conn.closed() => {}
                    }
                    drop(admitted);
                });
            }
            () = &mut stopped => break,
        }
    }
    drop(listener);
    let waiting = async {
        loop {
            connections.close_waiting();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        () = graceful.shutdown() => {}
        _ = waiting => {}
        () = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
}
