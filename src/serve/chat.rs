//! The chat template: how a list of messages becomes one prompt for a base model.
//!
//! tinygpt models are base models (trained on plain text, no chat turns), so the
//! template is plain text a base model continues sensibly, and the reply ends where
//! the model starts the user's next turn:
//!
//! ```text
//! {system message}\n\n            (each system message, if any)
//! User: {content}\n\n
//! Assistant: {content}\n\n
//! ...
//! Assistant:
//! ```

use super::error::ApiError;
use super::openai::{Content, Message};

/// What the reply is cut at besides the request's own stop strings: the model
/// beginning the user's next turn.
pub const STOPS: [&str; 2] = ["\nUser:", "\nSystem:"];

/// The template in words, for `GET /v1/chat/template`.
pub const DESCRIPTION: &str = "Plain text for a base model: each system message, then a blank line; each user turn as \"User: {content}\", each assistant turn as \"Assistant: {content}\", turns separated by blank lines; the prompt ends with \"Assistant:\" and the reply stops at \"\\nUser:\" or \"\\nSystem:\".";

/// The same template in Jinja, as a Hugging Face folder's tokenizer_config.json
/// (`chat_template`) and a GGUF file (`tokenizer.chat_template`) carry it, so that
/// transformers' `apply_chat_template` and llama.cpp's server build the prompt
/// [`render`] builds (with the generation prompt asked for). One line, its text in
/// string literals: the same whatever a renderer's whitespace options.
pub const JINJA: &str = "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' }}{% endif %}{{ message['content'] }}{{ '\\n\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";

/// The prompt for `messages`.
pub fn render(messages: &[Message]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages is empty: give at least one {\"role\": \"user\", \"content\": ...}",
        )
        .with_param("messages"));
    }
    let mut prompt = String::new();
    for (i, message) in messages.iter().enumerate() {
        let content = text_of(message.content.as_ref()).map_err(|why| {
            ApiError::invalid(format!("messages[{i}].content: {why}"))
                .with_param(&format!("messages[{i}].content"))
        })?;
        match message.role.as_str() {
            "system" | "developer" => prompt.push_str(&content),
            "user" => {
                prompt.push_str("User: ");
                prompt.push_str(&content);
            }
            "assistant" => {
                prompt.push_str("Assistant: ");
                prompt.push_str(&content);
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].role `{other}` is not one of system, developer, user, assistant"
                ))
                .with_param(&format!("messages[{i}].role")))
            }
        }
        prompt.push_str("\n\n");
    }
    prompt.push_str("Assistant:");
    Ok(prompt)
}

fn text_of(content: Option<&Content>) -> Result<String, String> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text.clone()),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(text)) => Ok(text.as_str()),
                (kind, _) => Err(format!(
                    "a part of type `{kind}`: this model reads text parts only"
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.concat()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: Some(Content::Text(content.into())),
        }
    }

    #[test]
    fn turns_become_plain_text_ending_where_the_assistant_speaks() {
        let prompt = render(&[
            message("system", "Be brief."),
            message("user", "Hi"),
            message("assistant", "Hello."),
            message("user", "Who are you?"),
        ])
        .unwrap();
        assert_eq!(
            prompt,
            "Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Who are you?\n\nAssistant:"
        );
        assert!(render(&[]).is_err());
        let err = render(&[message("tool", "x")]).unwrap_err();
        assert!(
            err.message.contains("messages[0].role `tool`"),
            "{}",
            err.message
        );
    }
}
