//! Experiment files and --set overrides: any text parses to a config or a clean error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tinygpt::config::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // The first lines that look like overrides are used as --set items, the rest as
    // the file, so both paths get exercised.
    let (overrides, file): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| l.starts_with("--set "));
    let overrides: Vec<String> = overrides.iter().map(|l| l["--set ".len()..].to_string()).collect();
    if let Ok(config) = Config::from_toml_str(&file.join("\n"), &overrides) {
        if config.validate().is_ok() {
            // A valid config always round-trips through its saved form.
            let again = Config::from_toml_str(&config.to_toml_string(), &[]).expect("saved config parses");
            assert_eq!(again, config);
        }
    }
});
